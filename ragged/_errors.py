"""Error types shared by every ragged module."""


class RaggedError(Exception):
    """Base class of every error ragged raises on purpose."""


class LayoutError(RaggedError, ValueError):
    """A parameter tree, spec tree or plan that cannot be laid out as asked.

    Attributes:
        path: key path of the offending leaf (``"['layers'][0]['w']"``), or ``None``.
        shape: shape of that leaf, or ``None``.
    """

    def __init__(self, message: str, *, path: str | None = None, shape=None):
        super().__init__(message)
        self.path = path
        self.shape = tuple(shape) if shape is not None else None


class PlanMismatchError(RaggedError, RuntimeError):
    """Ranks hold different plans (shapes, specs, world size): raised on every rank before
    any large collective starts."""


NO_PARAMS_MSG = (
    "make_plan got a parameter tree with no tensors. Pass a pytree whose leaves are torch "
    "tensors (meta tensors are fine), e.g. dict(model.named_parameters())."
)
