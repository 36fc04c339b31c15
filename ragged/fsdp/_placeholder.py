"""What is left on a module after :func:`ragged.fsdp.init`: placeholders instead of weights.

[Note: releasing the module's parameters]
After ``fsdp.init(units, model, ...)`` every rank keeps its shards, so the module's own full
weights would be one more model copy per rank (FSDP2's ``fully_shard`` replaces them by DTensor
shards for the same reason). :func:`release` replaces each parameter of the module by a
:class:`Placeholder`: a meta tensor (no memory) with the parameter's shape, dtype and
``requires_grad``, registered under every name the parameter had (tied weights share one
placeholder, so ``named_parameters(remove_duplicate=False)`` still shows the tie). What only
reads metadata keeps working: ``named_parameters()``, ``.shape``, ``.dtype``, ``make_units``,
``torch.func.functional_call`` (it swaps the placeholders out and back), HF ``model.dtype``,
``copy.deepcopy`` (a released copy). Anything that reads values (a forward through the module's
own attributes, ``state_dict()``, ``.to(...)``, an optimizer step) raises
:class:`ShardedParameterError`, naming the parameter and the fix, instead of computing on stale
or missing data. The original tensors are freed once nothing else refers to them (an optimizer
or a ``dict(model.named_parameters())`` the caller keeps holds them alive).
"""

from __future__ import annotations

import threading

import torch

from ragged._errors import RaggedError

__all__ = ["Placeholder", "ShardedParameterError", "release", "tied_names", "LOCK"]

LOCK = threading.RLock()
"""Serialises changes to a module shared by simulated ranks (threads of one process)."""


class ShardedParameterError(RaggedError, RuntimeError):
    """A torch call read the values of a module parameter that ``rg.fsdp.init`` sharded.

    Examples:
        >>> import torch, ragged as rg
        >>> from ragged import fsdp
        >>> model = torch.nn.Linear(2, 2)
        >>> units = fsdp.make_units(model, world_size=1)
        >>> state = rg.collectives.simulate(1, lambda comm: fsdp.init(units, model, rg.optim.sgd(0.1), comm))[0]
        >>> try:
        ...     model(torch.ones(2))                     # the module holds placeholders now
        ... except fsdp.ShardedParameterError as err:
        ...     print(str(err)[:55])
        parameters 'weight', 'bias' are sharded by rg.fsdp.init
    """


# calls that only read metadata (names as ``func.__name__``; properties as ``(property, "__get__")``)
_METADATA_CALLS = frozenset({
    "size", "dim", "stride", "numel", "nelement", "ndimension", "is_floating_point", "is_complex", "is_signed",
    "is_contiguous", "element_size", "storage_offset", "get_device", "requires_grad_", "__len__", "__hash__",
    "__format__", "has_names", "is_inference", "_is_view", "type", "untyped_storage", "data_ptr",  # meta: no bytes
})
_METADATA_PROPERTIES = frozenset({
    "shape", "dtype", "device", "requires_grad", "is_leaf", "grad", "grad_fn", "ndim", "layout", "is_cuda", "is_cpu",
    "is_sparse", "is_quantized", "is_meta", "is_mkldnn", "is_nested", "is_xpu", "is_mps", "names", "itemsize",
    "nbytes", "_base", "_version", "output_nr", "name", "_grad", "_grad_fn", "_backward_hooks",
    "_post_accumulate_grad_hooks", "__dict__",
})
_SETTABLE_PROPERTIES = frozenset({"requires_grad", "__dict__"})


def _reads_metadata_only(func, args) -> bool:
    name = getattr(func, "__name__", None)
    if name in ("__get__", "__set__"):
        prop = getattr(getattr(func, "__self__", None), "__name__", None)
        if name == "__set__" and prop == "grad":  # zero_grad(set_to_none=True)
            return len(args) > 1 and args[1] is None
        return prop in (_METADATA_PROPERTIES if name == "__get__" else _SETTABLE_PROPERTIES)
    if name == "type":  # t.type() names the type; t.type(dtype) converts
        return len(args) <= 1
    return name in _METADATA_CALLS


class Placeholder(torch.nn.Parameter):
    """Stands for a module parameter whose values ``rg.fsdp.init`` sharded (see [Note: releasing
    the module's parameters]): a meta tensor with the parameter's shape and dtype.

    Attributes:
        param_name: the parameter's name in the module (the first one, for tied weights).

    Examples:
        >>> import torch
        >>> from ragged.fsdp import Placeholder
        >>> p = Placeholder(torch.nn.Linear(2, 3).weight, "lin.weight")
        >>> p
        Placeholder('lin.weight', shape=(3, 2), dtype=torch.float32)
        >>> p.shape, p.requires_grad
        (torch.Size([3, 2]), True)
        >>> p * 2
        Traceback (most recent call last):
        ...
        ragged.fsdp._placeholder.ShardedParameterError: parameter 'lin.weight' is sharded by rg.fsdp.init: ...
    """

    def __new__(cls, like: torch.Tensor, param_name: str):
        with torch._C.DisableTorchFunctionSubclass():
            meta = torch.empty(tuple(like.shape), dtype=like.dtype, device="meta")
            requires_grad = bool(like.requires_grad)
        t = torch.Tensor._make_subclass(cls, meta, requires_grad)
        t.param_name = param_name
        return t

    def __init__(self, like: torch.Tensor, param_name: str):
        pass

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _reads_metadata_only(func, args):
            raise ShardedParameterError(_message(func, args, kwargs))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Placeholder({self.param_name!r}, shape={tuple(self.shape)}, dtype={self.dtype})"

    __str__ = __repr__

    def __deepcopy__(self, memo):
        out = Placeholder(self, self.param_name)
        memo[id(self)] = out
        return out

    def __reduce_ex__(self, protocol):
        raise ShardedParameterError(_message(None, (self,), {}))


def _message(func, args, kwargs) -> str:
    names = []
    for a in (*args, *kwargs.values()):
        for t in a if isinstance(a, (list, tuple)) else (a,):
            if isinstance(t, Placeholder) and t.param_name not in names:
                names.append(t.param_name)
    what = getattr(func, "__name__", None)
    if what in ("__get__", "__set__"):
        what = f".{getattr(func.__self__, '__name__', '?')}{' =' if what == '__set__' else ''}"
    return (f"parameter{'s' if len(names) > 1 else ''} {', '.join(map(repr, names)) or '?'} "
            f"{'are' if len(names) > 1 else 'is'} sharded by rg.fsdp.init: the module keeps a placeholder without "
            f"values, and a torch call{f' ({what})' if what else ''} used it. Fix: pass the parameters the step gives the "
            "loss (torch.func.functional_call(model, params, ...)); full values: rg.gather(units, shards, comm) / rg.fsdp.export "
            "(model.load_state_dict(full, assign=True) puts them back).")


def tied_names(module: torch.nn.Module) -> dict[str, str]:
    """``{alias: first name}`` for every parameter registered under more than one name
    (``named_parameters()`` lists only the first).

    Examples:
        >>> import torch
        >>> m = torch.nn.ModuleDict({"emb": torch.nn.Embedding(4, 2), "head": torch.nn.Linear(2, 4, bias=False)})
        >>> m["head"].weight = m["emb"].weight
        >>> tied_names(m)
        {'head.weight': 'emb.weight'}
    """
    first: dict[int, str] = {}
    aliases = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def release(module: torch.nn.Module) -> None:
    """Replaces every parameter of ``module`` (under all its names) by a :class:`Placeholder`.

    See [Note: releasing the module's parameters]. Idempotent; tied parameters keep sharing one
    placeholder. ``rg.fsdp.init`` calls it after sharding a module.

    Examples:
        >>> import torch
        >>> from ragged import fsdp
        >>> model = torch.nn.Linear(3, 2)
        >>> fsdp.release(model)
        >>> model.weight
        Placeholder('weight', shape=(2, 3), dtype=torch.float32)
        >>> [n for n, _ in model.named_parameters()]
        ['weight', 'bias']
    """
    with LOCK:
        canonical = {id(p): name for name, p in module.named_parameters()}
        replacement: dict[int, Placeholder] = {}
        for _, owner in module.named_modules(remove_duplicate=False):
            for key, p in list(owner._parameters.items()):
                if p is None or isinstance(p, Placeholder):
                    continue
                if id(p) not in replacement:
                    replacement[id(p)] = Placeholder(p, canonical[id(p)])
                owner._parameters[key] = replacement[id(p)]
