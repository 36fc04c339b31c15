"""An abstract comm: the shape of a shard group (and replica group) without processes.

[Note: lowering on an abstract comm]
``rg.fsdp.make_step`` and ``make_units`` only read a comm's ``world_size``, ``rank``,
``num_replicas``, ``replica_rank`` and ``device`` when they are built; the collectives run when
the step is called; the lowering also reads the ``handshake`` (a ``"deferred"`` comm's plan check
carries its ledger's digest: four int64 instead of two, see ``ragged/transforms/_check.py``).
:func:`abstract` gives those attributes for any world size (10,240 ranks on one CPU) and refuses
every collective, so a step built on it can be lowered (``step.lower(...)``, see
``ragged/predict/_lower.py``) but never run.
"""

from __future__ import annotations

import dataclasses

import torch

from ragged._errors import RaggedTypeError, RaggedValueError, check_int
from ragged.collectives._base import HANDSHAKES

__all__ = ["AbstractCollectives", "abstract"]

_REFUSED = ("all_gather_into", "all_gather_into_coalesced", "reduce_scatter_into", "reduce_scatter_into_coalesced",
            "all_reduce", "all_reduce_replicas", "all_to_all", "all_gather_object", "barrier")


def _refuse(name: str):
    def call(self, *args, **kwargs):
        raise RaggedValueError(
            f"{name}: this comm is abstract (rg.collectives.abstract(world_size={self.world_size}, ...)): it has no "
            "processes and moves no data. Fix: lower the step (step.lower(...)) instead of calling it, or build the "
            "step on rg.collectives.from_torch() / rg.collectives.simulate(...)."
        )
    call.__name__ = name
    return call


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class AbstractCollectives:
    """One rank's view of a shard group of ``world_size`` ranks (times ``num_replicas`` replica
    groups) that exists only on paper: see [Note: lowering on an abstract comm].

    Attributes:
        world_size, rank: the shard group's size and this rank's index in it.
        num_replicas, replica_rank: the replica group's (HSDP; 1 and 0 for plain FSDP).
        device: the device the step would run on (``meta`` by default: nothing is allocated).
        handshake: the transport's, as ``rg.collectives.from_torch(handshake=...)`` would have it
            (``"header"`` by default; ``"deferred"``, NCCL's shape, is what a GPU job and torch's
            fake process group get).

    Examples:
        >>> import ragged as rg
        >>> comm = rg.collectives.abstract(10240, rank=3)
        >>> comm.world_size, comm.rank, str(comm.device)
        (10240, 3, 'meta')
    """

    world_size: int
    rank: int = 0
    num_replicas: int = 1
    replica_rank: int = 0
    device: torch.device = torch.device("meta")
    handshake: str = "header"

    def __post_init__(self):
        check_int("abstract comm: world_size", self.world_size)
        check_int("abstract comm: num_replicas", self.num_replicas)
        check_int("abstract comm: rank", self.rank, 0, self.world_size)
        check_int("abstract comm: replica_rank", self.replica_rank, 0, self.num_replicas)
        if not isinstance(self.device, torch.device):
            object.__setattr__(self, "device", torch.device(self.device))
        if self.handshake not in HANDSHAKES:
            raise RaggedValueError(f"abstract comm: handshake must be one of {HANDSHAKES}, got {self.handshake!r}.")

    def ledger_digest(self) -> int | None:
        """What a comm of this handshake folds into its plan check: a digest (``"deferred"``) or ``None``."""
        return 0 if self.handshake == "deferred" else None

    def verify(self) -> None:
        return None

    def poison(self, reason: str) -> None:
        return None


for _name in _REFUSED:
    setattr(AbstractCollectives, _name, _refuse(_name))


def abstract(world_size: int, *, rank: int = 0, num_replicas: int = 1, replica_rank: int = 0,
             device: torch.device | str = "meta", handshake: str = "header") -> AbstractCollectives:
    """A comm of ``world_size`` ranks without processes, to build and lower a step at any scale.

    Args:
        world_size: ranks in the shard group.
        rank: the rank this comm speaks for (lowering reports every rank regardless).
        num_replicas, replica_rank: HSDP replica groups (all-reduced across).
        device: the device the step would compute on.
        handshake: the transport's (``"header"`` or ``"deferred"``: see
            :func:`~ragged.collectives.from_torch`); ``"deferred"`` plan checks are two int64 larger.

    Returns:
        An :class:`AbstractCollectives`: every collective raises.

    Examples:
        >>> import torch, ragged as rg
        >>> comm = rg.collectives.abstract(10_240)
        >>> comm.world_size, comm.rank, comm.device
        (10240, 0, device(type='meta'))
        >>> try:
        ...     comm.all_reduce(torch.zeros(1))
        ... except ValueError as err:
        ...     print(str(err)[:60])
        all_reduce: this comm is abstract (rg.collectives.abstract(w
        >>> comm = rg.collectives.abstract(512, rank=1, num_replicas=2, handshake="deferred")  # HSDP 2 x 512, NCCL's shape
        >>> comm.num_replicas, comm.ledger_digest()
        (2, 0)
    """
    if isinstance(device, bool) or not isinstance(device, (str, torch.device)):
        raise RaggedTypeError(f"abstract comm: device must be a torch.device or a string, got {device!r}.")
    return AbstractCollectives(world_size=world_size, rank=rank, num_replicas=num_replicas, replica_rank=replica_rank,
                               device=torch.device(device), handshake=handshake)
