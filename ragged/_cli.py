"""What every ``python -m ragged`` subcommand shares: option types that check a value as it is
parsed, the usage error, the dtype names, and ``--granularity`` (parsed, and applied to a model's
leaves where it can apply). The dispatch is ``ragged/__main__.py``.

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
import collections
import math
import re
import sys

import torch

from ragged import spec
from ragged._errors import RaggedValueError
from ragged._pytree import pytree

__all__ = ["ArgumentParser", "HelpFormatter", "UsageError", "usage_error", "int_at_least", "float_at_least",
           "float_above", "DTYPES", "parse_granularity", "unit_specs"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}


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


# ---- granularities -----------------------------------------------------------------------
_GRAN_RE = re.compile(r"^(rows|elements|blocks):(-?\d+)(?:x(-?\d+))?$")


def parse_granularity(text: str):
    """``rows:N``, ``elements:N`` or ``blocks:RxC`` -> a granularity.

    Examples:
        >>> parse_granularity("rows:16"), parse_granularity("blocks:128x128")
        (Rows(n=16), Blocks(r=128, c=128))
    """
    m = _GRAN_RE.match(text.strip().lower())
    if not m or (m.group(1) == "blocks") != (m.group(3) is not None):
        raise argparse.ArgumentTypeError(
            f"granularity {text!r} is not one of rows:N, elements:N, blocks:RxC (e.g. rows:16, blocks:128x128)"
        )
    kind, a = m.group(1), int(m.group(2))
    if kind == "blocks" and min(a, int(m.group(3))) < 1:
        raise argparse.ArgumentTypeError(f"granularity {text!r}: blocks:RxC needs R >= 1 and C >= 1")
    if a < 1:
        raise argparse.ArgumentTypeError(f"granularity {text!r}: {kind}:N needs N >= 1")
    return spec.Blocks(a, int(m.group(3))) if kind == "blocks" else {"rows": spec.Rows, "elements": spec.Elements}[kind](a)


def unit_specs(params, granularity):
    """A spec tree applying ``granularity`` to every leaf of ``params`` where it can apply.

    ``Blocks(r, c)`` only tiles 2-D and higher leaves: 1-D leaves (norms, biases) get
    ``Rows(1)`` (they are not block-quantized), and stacked matrices whose row count is not a
    multiple of ``r`` (GPT-OSS experts: 2880 rows, r=128) get whole matrices
    ``Rows(shape[-2])``, the finest cut that keeps every tile whole.

    Returns:
        ``(specs, notes)``: the spec tree and a list of human-readable fallbacks taken.
    """
    if not isinstance(granularity, spec.Blocks):
        return granularity, []
    leaves, treedef = pytree.flatten(params)
    specs, notes = [], collections.Counter()
    for leaf in leaves:
        shape = tuple(leaf.shape)
        if len(shape) < 2:
            specs.append(spec.Rows(1))
            notes["1-D leaves use Rows(1) (not block-tiled)"] += 1
        elif len(shape) >= 3 and math.prod(shape[:-2]) > 1 and shape[-2] % granularity.r:
            specs.append(spec.Rows(shape[-2]))
            key = f"stacked {shape} has {shape[-2]} rows per matrix, not a multiple of {granularity.r}: whole matrices Rows({shape[-2]})"
            notes[key] += 1
        else:
            specs.append(granularity)
    return pytree.unflatten(treedef, specs), [f"{k} [{n} leaves]" for k, n in notes.items()]
