"""What a layout is: granularities, plans and planners (no communication, no tensor data)."""

from ragged.spec._granularity import Blocks as Blocks
from ragged.spec._granularity import Elements as Elements
from ragged.spec._granularity import Granularity as Granularity
from ragged.spec._granularity import Replicate as Replicate
from ragged.spec._granularity import Rows as Rows
from ragged.spec._granularity import granule_of as granule_of
from ragged.spec._leaf import LeafLayout as LeafLayout
from ragged.spec._leaf import LocalPiece as LocalPiece
from ragged.spec._leaf import piece_shape as piece_shape
from ragged.spec._plan import LayoutPlan as LayoutPlan
from ragged.spec._planning import ORDERS as ORDERS
from ragged.spec._planning import STRATEGIES as STRATEGIES
from ragged.spec._planning import make_plan as make_plan
from ragged.spec._peers import PEERS as PEERS
from ragged.spec._peers import PeerPadding as PeerPadding
from ragged.spec._peers import peer_padding as peer_padding
from ragged.spec._peers import peer_shard_numel as peer_shard_numel
from ragged.spec._mesh import Mesh as Mesh
from ragged.spec._placements import Placements as Placements
from ragged.spec._placements import Shard as Shard
from ragged.spec._mesh_plan import MeshLeaf as MeshLeaf
from ragged.spec._mesh_plan import MeshPlan as MeshPlan
from ragged.spec._mesh_plan import make_mesh_plan as make_mesh_plan
