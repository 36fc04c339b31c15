"""Optional packages (``transformers``, ``peft``): imported where first needed, from any thread.

[Note: optional packages under simulate]
ragged imports an optional package only inside the helper that needs it, so that
``import ragged`` never pays for (nor requires) it. Under ``rg.collectives.simulate`` the ranks
are threads, and they reach such a helper at the same moment. CPython's per-module import lock
makes ``import x`` itself safe from several threads, but not what a package does lazily
*after* it is imported: ``transformers`` is a lazy module, whose ``transformers.LlamaConfig``
imports a submodule inside ``__getattr__`` and stores the class; two threads doing that at once
can find the attribute missing ("module 'transformers' has no attribute 'LlamaConfig'":
``ragged.examples.hf.config`` inside ``simulate(4, ...)`` failed 4 runs out of 4 with
transformers 5.25). So every optional import in ragged goes through :func:`optional`, which
imports the module and looks up the names the caller uses under one process-wide lock: a name
is resolved by one thread while the others wait, then read as a plain attribute.

``rich`` (a dependency, imported lazily only to keep ``import ragged`` fast) and torch's own
submodules are ordinary modules, which the import lock already makes safe: they stay plain
``import`` statements.
"""

from __future__ import annotations

import importlib
import threading
from typing import Any

__all__ = ["optional"]

_LOCK = threading.RLock()  # re-entrant: a package's import may import another through here


def optional(module: str, *names: str) -> Any:
    """``module`` imported, or its attributes ``names`` (one value, or a tuple for several),
    resolved under one process-wide lock (see [Note: optional packages under simulate]).

    Examples:
        >>> optional("json", "dumps")([1])
        '[1]'
        >>> optional("json").__name__
        'json'
    """
    with _LOCK:
        found = importlib.import_module(module)
        if not names:
            return found
        values = tuple(getattr(found, name) for name in names)
    return values[0] if len(values) == 1 else values
