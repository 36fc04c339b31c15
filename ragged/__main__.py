"""``python -m ragged <command>`` (also the ``ragged`` console script): the subcommand dispatch.

[Note: adding a subcommand]
Add one entry to :data:`SUBCOMMANDS`: ``name -> (help, "module:configure")``. ``configure``
receives the subcommand's ``argparse`` parser, adds its options and calls
``parser.set_defaults(func=handler)``; ``handler(args) -> int`` is the exit status. The option
types and errors every subcommand shares are ``ragged/_cli.py``'s (see [Note: bad command-line
values] there). Modules are named, not imported, here: each is imported when its subcommand runs
or ``--help`` lists it; this module is the top of the layering (docs/design.md), so naming them
is no upward import.
"""

from __future__ import annotations

import argparse
import importlib

import torch

import ragged
from ragged._cli import ArgumentParser, HelpFormatter, UsageError, usage_error

__all__ = ["SUBCOMMANDS", "build_parser", "main"]

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("plan every FSDP unit of a model and compare padding with FSDP2/FSDP1/ZeRO-3/Megatron-FSDP",
             "ragged._cli_plan:configure"),
    "train": ("train the example GPT (dense or --moe) with the functional FSDP step on gloo/NCCL ranks",
              "ragged.examples.train:configure"),
}


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m ragged`` parser, every subcommand configured."""
    parser = ArgumentParser(prog="python -m ragged", description="ragged: RaggedShard planning and FSDP tools.")
    parser.add_argument("--version", action="version", version=f"ragged {ragged.__version__} (torch {torch.__version__})")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (help_text, target) in SUBCOMMANDS.items():
        module, func = target.split(":")
        p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=HelpFormatter)
        getattr(importlib.import_module(module), func)(p)
    return parser


def main(argv=None) -> int:
    """Parses ``argv`` (default: ``sys.argv[1:]``) and runs the chosen subcommand; a
    :class:`~ragged._cli.UsageError` ends as one line on stderr and exit status 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UsageError as err:
        usage_error(f"{parser.prog} {args.command}", err)


if __name__ == "__main__":
    raise SystemExit(main())
