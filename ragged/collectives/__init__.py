"""Collectives: one small protocol, a torch.distributed backend and an in-process simulation."""

from ragged.collectives._base import DEFAULT_TIMEOUT as DEFAULT_TIMEOUT
from ragged.collectives._base import CallScope as CallScope
from ragged.collectives._base import Collectives as Collectives
from ragged.collectives._base import Handle as Handle
from ragged.collectives._base import poison_on_error as poison_on_error
from ragged.collectives._simulated import SimulatedCollectives as SimulatedCollectives
from ragged.collectives._simulated import simulate as simulate
from ragged.collectives._torch import TorchCollectives as TorchCollectives
from ragged.collectives._torch import from_torch as from_torch
from ragged._errors import CollectiveError as CollectiveError
from ragged.collectives._abstract import AbstractCollectives as AbstractCollectives
from ragged.collectives._abstract import abstract as abstract
