"""Sharded checkpoints with torch.distributed.checkpoint: save each rank's ragged pieces, load
into any world size or plan, consolidate one into a single file."""

from ragged.checkpoint._dcp import SingleProcess as SingleProcess
from ragged.checkpoint._format import CheckpointCorruptError as CheckpointCorruptError
from ragged.checkpoint._format import CheckpointError as CheckpointError
from ragged.checkpoint._format import CheckpointMismatchError as CheckpointMismatchError
from ragged.checkpoint._format import CheckpointNotFoundError as CheckpointNotFoundError
from ragged.checkpoint._format import PerRank as PerRank
from ragged.checkpoint._load import consolidate as consolidate
from ragged.checkpoint._packed import Packed as Packed
from ragged.checkpoint._packed import bind_muon as bind_muon
from ragged.checkpoint._packed import bind_packed as bind_packed
from ragged.checkpoint._quant8 import Quant8 as Quant8
from ragged.checkpoint._quant8 import bind_quant8 as bind_quant8
from ragged.checkpoint._quant8 import unbind as unbind
from ragged.checkpoint._load import load as load
from ragged.checkpoint._load import read_manifest as read_manifest
from ragged.checkpoint._save import save as save
from ragged.checkpoint._background import SaveHandle as SaveHandle
from ragged.checkpoint._pretrained import Pretrained as Pretrained
from ragged.checkpoint._pretrained import pretrained as pretrained
from ragged.checkpoint._fsdp2 import FSDP2Checkpoint as FSDP2Checkpoint
from ragged.checkpoint._fsdp2 import fsdp2 as fsdp2
