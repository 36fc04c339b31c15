"""The ``python -m ragged`` command line: subcommand dispatch and the option types and errors
every subcommand shares (``plan``: ``_cli_plan.py``; ``train``: ``ragged/examples/_train_args.py``).

[Note: adding a subcommand]
Add one entry to :data:`SUBCOMMANDS`: ``name -> (help, "module:configure")``. ``configure``
receives the subcommand's ``argparse`` parser, adds its options and calls
``parser.set_defaults(func=handler)``; ``handler(args) -> int`` is the exit status. Modules
are imported only when their subcommand runs (or ``--help`` lists it), so a heavy
subcommand costs nothing to the others.

[Note: bad command-line values]
Every option is checked before anything runs (no process started, no model built): a
per-value check is an argparse ``type=`` (:func:`int_at_least`, :func:`float_above`, ...),
a check across options raises :class:`UsageError` at the top of the handler. Both end as one
line on stderr, ``python -m ragged train: error: ... (see --help)``, and exit status 2 (the
argparse convention), never a traceback. ``--help`` shows every default
(:class:`HelpFormatter`).
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys

from ragged._errors import RaggedValueError

__all__ = ["run", "build_parser", "SUBCOMMANDS", "ArgumentParser", "HelpFormatter", "UsageError", "usage_error",
           "int_at_least", "float_at_least", "float_above"]

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("plan every FSDP unit of a model and compare padding with FSDP2/FSDP1/ZeRO-3/Megatron-FSDP",
             "ragged._cli_plan:configure"),
    "train": ("train the example GPT (dense or --moe) with the functional FSDP step on gloo/NCCL ranks",
              "ragged.examples.train:configure"),
}


class UsageError(RaggedValueError):
    """A command-line value that cannot work (see [Note: bad command-line values])."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: X)`` after every option that has a default (not after flags or
    options whose default is None, whose help says what happens then)."""

    def _get_help_string(self, action):
        help_text = action.help or ""
        if "%(default)" in help_text or action.default in (None, False, argparse.SUPPRESS) or action.nargs == 0:
            return help_text
        return super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one line on stderr and exit status 2 (no usage block).

    Examples:
        >>> import contextlib, io
        >>> p = ArgumentParser(prog="demo")
        >>> _ = p.add_argument("--steps", type=int_at_least(1), default=1)
        >>> err = io.StringIO()
        >>> with contextlib.redirect_stderr(err):
        ...     try:
        ...         p.parse_args(["--steps", "0"])
        ...     except SystemExit as e:
        ...         print(e.code)
        2
        >>> print(err.getvalue(), end="")
        demo: error: argument --steps: must be >= 1, got 0 (see demo --help)
    """

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        usage_error(self.prog, message)


def usage_error(prog: str, message: str):
    """Ends the program the argparse way: ``prog: error: message`` on stderr, exit status 2."""
    sys.stderr.write(f"{prog}: error: {str(message).rstrip('.')} (see {prog} --help)\n")
    raise SystemExit(2)


def int_at_least(low: int):
    """An argparse ``type``: an int ``>= low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {text}")
        return value

    return parse


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def float_at_least(low: float):
    """An argparse ``type``: a finite float ``>= low``."""
    return _float_bound(low, strict=False)


def float_above(low: float):
    """An argparse ``type``: a finite float ``> low``."""
    return _float_bound(low, strict=True)


def _float_bound(low: float, *, strict: bool):
    def parse(text: str) -> float:
        value = _float(text)
        if value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {low:g}, got {text}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m ragged", description="ragged: RaggedShard planning and FSDP tools.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (help_text, target) in SUBCOMMANDS.items():
        module, func = target.split(":")
        p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=HelpFormatter)
        getattr(importlib.import_module(module), func)(p)
    return parser


def run(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UsageError as err:
        usage_error(f"{parser.prog} {args.command}", err)
