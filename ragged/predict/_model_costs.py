"""Analytic costs of a model from its shapes (:mod:`ragged.models`): forward flops per token and
activation bytes per FSDP unit, for ``python -m ragged plan --predict``'s step time and peak.

[Note: flops of a unit]
A token's forward through a unit costs 2 flops (a multiply and an add) per parameter it uses:
every parameter of a decoder layer (attention, dense MLP, router, shared experts, norms and
biases alike: norms and biases are a rounding error next to the matrices), but of the routed
experts only ``num_experts_per_tok`` of ``E`` (the shapes' ``config``; ``E`` from the shapes: the
indices of ``experts.{0..E-1}.*``, or dim 0 of a stacked ``experts.*`` tensor). The embedding (kind
``"embed"``) is a lookup: 0 flops; the head (kind ``"head"``) is a matmul over the vocabulary.
Not counted: attention's scores and weighted sum (``QK^T`` and ``AV``: about ``4 * s * d_attn`` per
token and layer, halved by causality), which grow with the sequence, not the parameters. Backward
is left to ``estimate_time``'s ``backward_factor`` (2x forward; 3x with full recomputation). These
are the lowering's inputs, not part of it: a loss function's flops cannot be read off a step, so
they live here, next to the shapes they are counted from.

[Note: activations of a unit]
Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
(arXiv:2205.05198), for a micro-batch of ``b`` sequences of ``s`` tokens, hidden size ``h``,
vocabulary ``v``, activations in 16 bits, no tensor or sequence parallelism:

* a decoder layer saves ``34 * s * b * h`` bytes for backward; their ``5 * a * s^2 * b`` of the
  attention scores is left out (flash attention keeps none); with full recomputation it keeps
  only its input, ``2 * s * b * h``, and its backward recomputes it (``34 * s * b * h`` alive while
  it runs, one layer at a time);
* the output layer saves ``4 * s * b * h`` (final norm and projection inputs) plus the logits in
  fp32, ``4 * s * b * v``, whose gradient is as large while its backward runs.

Assumed on top of the paper: a layer's backward also holds its output's and its input's gradient
(``4 * s * b * h``); transients inside a forward are not counted; the embedding saves nothing (its
output is the first layer's input). The formula is a dense GPT layer's with a ``4h`` MLP: a MoE
layer's expert activations and GQA's smaller K/V differ from it. Assumptions, not measurements:
``rg.predict.profile_activations`` measures a real step's.
"""

from __future__ import annotations

import dataclasses

from ragged._errors import RaggedValueError, check_int
from ragged._models import model_shapes, model_units
from ragged.predict._activations import Activations

__all__ = ["UnitCost", "unit_costs", "step_activations"]

LAYER_BYTES = 34  # per s * b * h: a decoder layer's saved activations (Korthikanti et al. 2022)
CHECKPOINT_BYTES = 2  # per s * b * h: the layer input full recomputation keeps
GRAD_BYTES = 4  # per s * b * h: a layer's output and input gradients while its backward runs (assumed)
HEAD_BYTES, LOGIT_BYTES = 4, 4  # per s * b * h and per s * b * v: the output layer's (Korthikanti et al. 2022)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class UnitCost:
    """One FSDP unit's analytic costs for one micro-batch (see [Note: flops of a unit] and
    [Note: activations of a unit]).

    Attributes:
        name: the unit, as :func:`ragged.models.model_units` names it.
        layers: decoder layers in it (0: the embedding, the head).
        flops_per_token: forward flops of one token through it.
        saved_bytes: what its forward keeps until its backward.
        backward_bytes: what its backward holds beyond everything saved up to it.
    """

    name: str
    layers: int
    flops_per_token: int
    saved_bytes: int
    backward_bytes: int


def _routed(name: str, shape, groups: dict) -> tuple[str, int] | None:
    """``(group, E)`` when ``name`` is a routed expert's parameter (``E`` known for stacked ones)."""
    parts = name.split(".")
    if "experts" not in parts:
        return None
    i = parts.index("experts")
    group = ".".join(parts[:i])
    if i + 1 < len(parts) and parts[i + 1].isdigit():  # experts.{0..E-1}.w: E counted over the layer
        groups.setdefault(group, set()).add(parts[i + 1])
        return group, 0
    return group, shape[0] if shape else 1  # a stacked tensor: [experts, ...]


def _layer_flops(layer: str, params: dict, experts_per_token) -> int:
    groups: dict[str, set] = {}
    dense, routed = 0, []
    for name, t in params.items():
        n = t.numel()
        hit = _routed(name, tuple(t.shape), groups)
        if hit is None:
            dense += n
        else:
            if experts_per_token is None:
                raise RaggedValueError(f"{layer} has routed experts ({name!r}) but the shapes have no "
                                       "config.num_experts_per_tok; add \"config\": {\"num_experts_per_tok\": K} to them")
            routed.append((n, *hit))
    used = sum(n * experts_per_token / (e or len(groups[g])) for n, g, e in routed)
    return 2 * (dense + round(used))


def unit_costs(model, *, seq_len: int, batch: int, checkpointing: bool = False,
               layers_per_unit: int = 1) -> tuple[UnitCost, ...]:
    """Per unit, forward flops per token and activation bytes of a micro-batch of ``batch`` x
    ``seq_len`` tokens (see [Note: flops of a unit] and [Note: activations of a unit]).

    Args:
        model: a bundled name, a shapes JSON path or a loaded description (:mod:`ragged.models`).
        seq_len, batch: the micro-batch per rank.
        checkpointing: full activation recomputation of every decoder layer.
        layers_per_unit: as in :func:`ragged.models.model_units` (the same units, the same names).

    Returns:
        One :class:`UnitCost` per unit, in unit order.

    Raises:
        ValueError: routed experts without ``config.num_experts_per_tok``, or no unit of kind
            ``"embed"`` holding one ``[vocab, hidden]`` matrix.

    Examples:
        >>> costs = unit_costs("gpt-oss-120b", seq_len=4096, batch=1)
        >>> [(c.name, c.layers) for c in costs[:2]], costs[0].flops_per_token
        ([('embed', 0), ('layers.0', 1)], 0)
        >>> round(sum(c.flops_per_token for c in costs) / 2e9, 2)   # billions of parameters a token uses
        5.13
        >>> costs[1].saved_bytes == 34 * 4096 * 2880
        True
        >>> unit_costs("gpt-oss-120b", seq_len=4096, batch=1, checkpointing=True)[1].saved_bytes == 2 * 4096 * 2880
        True
    """
    check_int("unit_costs: seq_len", seq_len)
    check_int("unit_costs: batch", batch)
    desc = model_shapes(model)
    k = desc.get("config", {}).get("num_experts_per_tok")
    units = model_units(desc, layers_per_unit=layers_per_unit)
    embed = [t for u in units if u.kind == "embed" for t in u.params.values() if t.dim() == 2]
    if len(embed) != 1:
        raise RaggedValueError("the activation estimate reads the hidden and vocabulary sizes off the embedding: it "
                               "needs one unit of kind 'embed' with one [vocab, hidden] matrix, found "
                               f"{len(embed)} such matrices")
    vocab, hidden = embed[0].shape
    sbh, sbv = seq_len * batch * hidden, seq_len * batch * vocab
    out = []
    for u in units:
        if u.kind == "embed":
            out.append(UnitCost(name=u.name, layers=0, flops_per_token=0, saved_bytes=0, backward_bytes=0))
        elif u.kind == "head":
            out.append(UnitCost(name=u.name, layers=0, flops_per_token=2 * sum(t.numel() for t in u.params.values()),
                                saved_bytes=HEAD_BYTES * sbh + LOGIT_BYTES * sbv, backward_bytes=LOGIT_BYTES * sbv))
        else:
            merged = isinstance(next(iter(u.params.values())), dict)  # {layer name: {param: tensor}}
            layers = u.params if merged else {u.name: u.params}
            keep = CHECKPOINT_BYTES if checkpointing else LAYER_BYTES
            out.append(UnitCost(name=u.name, layers=len(layers),
                                flops_per_token=sum(_layer_flops(n, p, k) for n, p in layers.items()),
                                saved_bytes=len(layers) * keep * sbh,
                                backward_bytes=(GRAD_BYTES + (LAYER_BYTES if checkpointing else 0)) * sbh))
    return tuple(out)


def step_activations(costs, schedule):
    """The activations of ``costs`` (in the step's unit order) at the points of ``schedule``, as
    ``step.lower(activations=...)`` takes them: a forward entry holds everything saved up to and
    including its unit; a backward segment that plus its unit's ``backward_bytes``; backward event
    ``e`` what the entries before ``e`` saved.

    Examples:
        >>> from ragged.fsdp._schedule import CollectiveSchedule
        >>> two = CollectiveSchedule(forward=(0, 1), needs=(frozenset({0}), frozenset({1})), reduce_at=(0, 1),
        ...                          learning=False)
        >>> costs = [UnitCost(name=n, layers=1, flops_per_token=0, saved_bytes=10, backward_bytes=5) for n in "ab"]
        >>> act = step_activations(costs, two)
        >>> act.forward, act.backward, act.events, act.saved
        ((10, 20), ((15, 15), (25, 25)), (0, 10, 20), 20)
    """
    if len(costs) != len(schedule.reduce_at):
        raise RaggedValueError(f"step_activations: {len(costs)} unit costs for a schedule over "
                               f"{len(schedule.reduce_at)} units; pass one UnitCost per unit of the step")
    seen, cum = set(), [0]
    for u in schedule.forward:  # a unit read again (a tied head) saves nothing new
        cum.append(cum[-1] + (0 if u in seen else costs[u].saved_bytes))
        seen.add(u)
    n = len(schedule.forward)
    backward = tuple((cum[c + 1] + costs[u].backward_bytes,) * 2 for c, u in enumerate(schedule.forward))
    return Activations(schedule=schedule, forward=tuple(cum[1:]), backward=backward, events=tuple(cum[:n + 1]),
                       saved=cum[n])
