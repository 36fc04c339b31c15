"""``python -m ragged <command>`` (also the ``ragged`` console script)."""

from __future__ import annotations


def main(argv=None) -> int:
    """Parses ``argv`` (default: ``sys.argv[1:]``) and runs the chosen subcommand."""
    from ragged._cli import run

    return run(argv)


if __name__ == "__main__":
    raise SystemExit(main())
