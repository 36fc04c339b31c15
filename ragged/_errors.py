"""Error types shared by every ragged module."""


class RaggedError(Exception):
    """Base class of every error ragged raises on purpose.

    Each deliberate error is also the builtin exception its kind calls for (``ValueError`` for a
    wrong value, ``TypeError`` for a wrong kind of value, ``KeyError`` for a missing name), so
    ``except ValueError`` keeps working and ``except rg.RaggedError`` catches everything ragged
    refuses.

    Examples:
        >>> import ragged as rg
        >>> try:
        ...     rg.spec.Rows(0)
        ... except rg.RaggedError as err:
        ...     print(type(err).__name__, isinstance(err, ValueError))
        RaggedValueError True
    """


class RaggedValueError(RaggedError, ValueError):
    """A value ragged cannot accept (an option out of range, a tree of the wrong structure).

    Examples:
        >>> import torch, ragged as rg
        >>> rg.make_plan({"w": torch.empty(4)}, world_size=0)
        Traceback (most recent call last):
        ...
        ragged._errors.RaggedValueError: ...
    """


class RaggedTypeError(RaggedError, TypeError):
    """A value of the wrong kind (a module where a tree was expected, a spec that is no spec).

    Examples:
        >>> import ragged as rg
        >>> rg.shard({"not": "a layout"}, {}, None)
        Traceback (most recent call last):
        ...
        ragged._errors.RaggedTypeError: shard: the layout must be a LayoutPlan (rg.make_plan), fsdp.Units ...
    """


class RaggedKeyError(RaggedError, KeyError):
    """A name that is not there (a unit, a leaf path, a mesh axis, a checkpoint entry).

    Examples:
        >>> import torch
        >>> from ragged import spec
        >>> mplan = spec.make_mesh_plan({"w": torch.empty(2)}, None, mesh=spec.Mesh((2,), ("dp",)))
        >>> mplan.leaf("['nope']")
        Traceback (most recent call last):
        ...
        ragged._errors.RaggedKeyError: 'no leaf at ...; paths are ...'
    """


class LayoutError(RaggedError, ValueError):
    """A parameter tree, spec tree or plan that cannot be laid out as asked.

    Attributes:
        path: key path of the offending leaf (``"['layers'][0]['w']"``), or ``None``.
        shape: shape of that leaf, or ``None``.

    Examples:
        >>> import torch, ragged as rg
        >>> try:
        ...     rg.make_plan({"b": torch.empty(3)}, rg.spec.Blocks(2, 2), world_size=2)
        ... except rg.LayoutError as err:
        ...     print(err.path, err.shape, isinstance(err, ValueError))
        ['b'] (3,) True
    """

    def __init__(self, message: str, *, path: str | None = None, shape=None):
        super().__init__(message)
        self.path = path
        self.shape = tuple(shape) if shape is not None else None


class PlanMismatchError(RaggedError, RuntimeError):
    """Ranks hold different plans (shapes, specs, world size) or issue different collectives
    (operation, dtype, size, plan, label): raised on every rank before the data moves.

    Examples:
        >>> import torch, ragged as rg
        >>> def fn(comm):                              # rank 1 planned a longer leaf
        ...     n = 4 + 2 * comm.rank
        ...     plan = rg.make_plan({"w": torch.empty(n)}, world_size=2)
        ...     try:
        ...         rg.gather(rg.shard(plan, {"w": torch.zeros(n)}, comm), comm)
        ...     except rg.PlanMismatchError as err:
        ...         return type(err).__name__, str(err).startswith("ranks hold different plans")
        >>> rg.collectives.simulate(2, fn)             # every rank raises, before any data moves
        [('PlanMismatchError', True), ('PlanMismatchError', True)]
    """


class CollectiveError(RaggedError, RuntimeError):
    """A collective cannot complete: a peer failed (and said why), died, or did not arrive
    within the comm's timeout. The comm refuses further calls afterwards.

    Attributes:
        peer: the rank (in the comm's group) the error is about, or ``None``.
    """

    def __init__(self, message: str, *, peer: int | None = None):
        super().__init__(message)
        self.peer = peer


def check_int(name: str, value, low: int | None = 1, high: int | None = None, *, fix: str = "") -> int:
    """``value`` when it is an int (not a bool) in ``[low, high)`` (``None``: unbounded); else a
    RaggedValueError naming ``name`` (and ending with ``fix``)."""
    if (isinstance(value, bool) or not isinstance(value, int) or (low is not None and value < low)
            or (high is not None and value >= high)):
        kind = (f"an int in [{low}, {high})" if high is not None
                else {None: "an int", 0: "a non-negative int", 1: "a positive int"}.get(low, f"an int >= {low}"))
        raise RaggedValueError(f"{name} must be {kind}, got {value!r}.{fix}")
    return value


def is_sizes(values) -> bool:
    """Whether every one of ``values`` is an int (not a bool) >= 0: a shape or byte range read from a file."""
    return all(type(v) is int and v >= 0 for v in values)


NO_PARAMS_MSG = (
    "make_plan got a parameter tree with no tensors. Pass a pytree whose leaves are torch "
    "tensors (meta tensors are fine), e.g. dict(model.named_parameters())."
)
