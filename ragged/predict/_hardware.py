"""The hardware ``plan --predict`` prices a step on: every constant an option whose default is a
vendor's figure (or plainly an assumption), printed with its source, never as a measurement.

[Note: the assumed cluster]
Defaults describe an NVIDIA DGX H100 cluster:

* compute: a unit's forward seconds = its flops (``ragged/predict/_model_costs.py``) / (peak x MFU); peak =
  989 TFLOP/s, the H100 SXM's dense BF16 Tensor Core figure (NVIDIA H100 datasheet: 1,979 with
  sparsity); MFU 0.4, an assumption (a good large-scale run's utilisation, not a figure of ours);
* links: one per mesh axis (``rg.predict.Network``). An axis whose ranks all sit in one node (8 GPUs per
  node) moves data over NVLink, 450 GB/s per direction per GPU (datasheet: 900 GB/s
  bidirectional); an axis that spans nodes over InfiniBand, 50 GB/s per GPU (DGX H100: one
  ConnectX-7 400 Gb/s NDR port per GPU). The shard group is contiguous ranks; HSDP's replica
  group strides by the shard group's size;
* latency per call: NCCL's own cost model of a ring all-gather / reduce-scatter (NCCL
  ``src/graph/tuning.cc``, ring algorithm, Simple protocol): a base of 8.4 us plus, per ring step,
  3.4 us inside a node (NVLink) or 14 us across nodes (network), ``n - 1`` steps of which
  ``nodes - 1`` cross nodes. A ring's latency grows with the group, which is what makes one
  10K-rank shard group slow and HSDP's smaller one fast; NCCL's tree and PAT algorithms grow with
  its logarithm instead, so this is pessimistic for small messages at scale.
"""

from __future__ import annotations

import dataclasses

from ragged._cli import UsageError, float_above, int_at_least
from ragged.predict._time import Link, Network

__all__ = ["Hardware", "configure_hardware", "hardware_from"]

# (field, option, metavar, unit, source): one row per constant, the single place each is defined
_OPTIONS = (
    ("peak_tflops", "--peak-tflops", "TFLOP/S", "TFLOP/s per device",
     "H100 SXM dense BF16, NVIDIA H100 datasheet (1,979 with sparsity)"),
    ("mfu", "--mfu", "FRACTION", "of peak", "assumed model flops utilisation"),
    ("gpus_per_node", "--gpus-per-node", "N", "GPUs per node", "DGX H100"),
    ("nvlink_bandwidth", "--nvlink-bandwidth", "GB/S", "GB/s per GPU inside a node",
     "NVLink 4, NVIDIA H100 datasheet: 900 GB/s bidirectional"),
    ("ib_bandwidth", "--ib-bandwidth", "GB/S", "GB/s per GPU across nodes",
     "DGX H100: one ConnectX-7 400 Gb/s NDR InfiniBand port per GPU"),
    ("base_latency", "--base-latency", "US", "us per collective call", "NCCL tuning.cc baseLat, ring/Simple"),
    ("nvlink_latency", "--nvlink-latency", "US", "us per ring step inside a node",
     "NCCL tuning.cc hwLat NVLink, ring/Simple"),
    ("ib_latency", "--ib-latency", "US", "us per ring step across nodes", "NCCL tuning.cc hwLat NET, ring/Simple"),
)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Hardware:
    """The devices and links a step is priced on (see [Note: the assumed cluster]).

    Examples:
        >>> hw = Hardware()
        >>> round(hw.seconds(989e12 * 0.4), 6)            # one second of flops at peak x MFU
        1.0
        >>> net = hw.network(shard=1024, replicas=2)      # shard group over 128 nodes, replicas across nodes
        >>> net.shard.bandwidth, round(net.shard.alpha * 1e6, 1)   # 8.4 + 896 x 3.4 + 127 x 14 us
        (50000000000.0, 4832.8)
        >>> hw.network(shard=8, replicas=1).shard.bandwidth   # one node: NVLink
        450000000000.0
    """

    peak_tflops: float = 989.0
    mfu: float = 0.4
    gpus_per_node: int = 8
    nvlink_bandwidth: float = 450.0
    ib_bandwidth: float = 50.0
    base_latency: float = 8.4
    nvlink_latency: float = 3.4
    ib_latency: float = 14.0

    def seconds(self, flops: float) -> float:
        """Seconds ``flops`` take on one device at peak x MFU."""
        return flops / (self.peak_tflops * 1e12 * self.mfu)

    def link(self, ranks: int, stride: int):
        """The link of a group of ``ranks`` ranks ``stride`` apart (NCCL's ring model, see the Note)."""
        per_node = min(ranks, max(1, self.gpus_per_node // stride))
        nodes = -(-ranks // per_node)
        steps, across = ranks - 1, nodes - 1
        alpha = (self.base_latency + (steps - across) * self.nvlink_latency + across * self.ib_latency) * 1e-6
        return Link(alpha=alpha, bandwidth=(self.ib_bandwidth if nodes > 1 else self.nvlink_bandwidth) * 1e9)

    def network(self, *, shard: int, replicas: int):
        """A :class:`~ragged.predict.Network` for a mesh of ``replicas`` x ``shard`` ranks (shard ranks contiguous)."""
        return Network(shard=self.link(shard, 1), replica=self.link(replicas, shard) if replicas > 1 else None)

    def assumed(self) -> list[str]:
        """One labelled line per constant: its value, unit and source."""
        return [f"{option.lstrip('-')} = {getattr(self, field):g} {unit} (ASSUMED: {source})"
                for field, option, _, unit, source in _OPTIONS]


def configure_hardware(p) -> None:
    """Adds one option per :class:`Hardware` constant to ``p`` (their defaults are the class's)."""
    group = p.add_argument_group("step time (with --predict): assumed hardware, see [Note: the assumed cluster] "
                                 "in ragged/predict/_hardware.py")
    defaults = Hardware()
    for field, option, metavar, unit, source in _OPTIONS:
        kind = int_at_least(1) if field == "gpus_per_node" else float_above(0.0)
        group.add_argument(option, dest=field, type=kind, default=getattr(defaults, field), metavar=metavar,
                           help=f"{unit}; {source}")


def hardware_from(args) -> Hardware:
    """The :class:`Hardware` of parsed options (see :func:`configure_hardware`)."""
    if args.mfu > 1:
        raise UsageError(f"--mfu {args.mfu:g} is a fraction of peak: it must be in (0, 1], e.g. 0.4")
    return Hardware(**{field: getattr(args, field) for field, *_ in _OPTIONS})
