"""Real models through ``rg.fsdp.make_step`` on 2 gloo ranks, float64, against single-process
``torch.optim.AdamW`` on the whole batch (computed in each worker): Hugging Face Llama (tied and
untied) and Mixtral (fused experts), a ModuleList-expert MoE whose experts are idle on some
ranks (every expert its own unit, and one unit per layer), activation checkpointing inside the
model (Hugging Face ``gradient_checkpointing_enable`` with both ``use_reentrant`` values, and
``torch.utils.checkpoint`` in a module's forward), and the misuse cases, which raise a ragged
error on every rank before any parameter changes. No case may end in a gloo abort or timeout:
the harness would report it as ``WorkerTimeout``."""

import os
import tempfile

import pytest
import torch

import ragged as rg
from ragged import fsdp
from tests.distributed._harness import both_transports, comm, workers_fixture
from tests.distributed._harness import transport as transport_options
from tests.fsdp._cases import (cross_entropy, hf_model, lm_batches, logits_of, max_diff, moe_batches, tiny_moe,
                               train_reference, train_sharded)

pytestmark = pytest.mark.distributed

workers2 = workers_fixture(2)
transport = both_transports()
_MODELS = {"tiny_moe": tiny_moe, "hf": hf_model}


def _compare(builder, kwargs, batches_fn, train_kw, ref_kwargs=None):
    make = lambda kw: _MODELS[builder](**kw)  # noqa: E731
    batches = batches_fn()
    params, metrics = train_sharded(comm(), make(kwargs), batches, **train_kw)
    ref = train_reference(make(kwargs if ref_kwargs is None else ref_kwargs), batches)
    init = dict(make(kwargs).named_parameters())
    diff, where = max_diff(params, ref)
    return dict(diff=diff, where=where, moved=max_diff(params, init)[0], metrics=[
        {k: v for k, v in m.items() if k != "trace"} for m in metrics], unchanged=[
        k for k in init if torch.equal(params[k], init[k].detach())])


CASES = {
    "llama-untied-functional_call": ("hf", dict(kind="llama"), lm_batches, dict(module=False)),
    "llama-tied-module": ("hf", dict(kind="llama", tied=True), lm_batches, dict(module=True)),
    "mixtral-fused-experts": ("hf", dict(kind="mixtral"), lm_batches, dict(module=False)),
    "llama-hf-checkpointing-nonreentrant": ("hf", dict(kind="llama", checkpointing=False), lm_batches,
                                            dict(module=True), dict(kind="llama")),
    "llama-tied-hf-checkpointing-reentrant": ("hf", dict(kind="llama", tied=True, checkpointing=True), lm_batches,
                                              dict(module=True), dict(kind="llama", tied=True)),
    "moduleList-moe-expert-units": ("tiny_moe", {}, moe_batches, dict(module=True)),
    "moduleList-moe-layer-units": ("tiny_moe", {}, moe_batches, dict(module=False, groups=["layers.0", "layers.1"])),
    "moduleList-moe-checkpoint-in-forward": ("tiny_moe", dict(checkpoint=True), moe_batches, dict(module=True),
                                             {}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_torch_adamw(workers2, name):
    for r, out in enumerate(workers2.run(_compare, *CASES[name])):
        assert out["diff"] <= 1e-10, f"rank {r}: {out['where']} differs by {out['diff']}"
        assert out["moved"] > 1e-3
        assert all(m["schedule_reruns"] == 0 for m in out["metrics"][1:]), out["metrics"]
        if name.startswith("moduleList"):
            # expert 3 of every layer gets no token on any rank: torch.optim skips it, so does the step
            idle = {k for k in out["unchanged"] if ".experts.3." in k}
            assert idle and idle == set(out["unchanged"]), out["unchanged"]
            assert all(m["unused_leaves"] == 4 for m in out["metrics"])


def _recompute_counts(checkpoint):
    model = tiny_moe(checkpoint=checkpoint)
    _, metrics = train_sharded(comm(), model, moe_batches(steps=2), module=True)
    attempts = sum(1 + m["schedule_reruns"] for m in metrics)
    return [layer.calls for layer in model.layers], attempts, metrics[-1]["saved_activation_bytes"]


def test_checkpointing_in_the_model_really_recomputes(workers2):
    for (plain_calls, plain_runs, plain_bytes), (ckpt_calls, ckpt_runs, ckpt_bytes) in zip(
            workers2.run(_recompute_counts, False), workers2.run(_recompute_counts, True)):
        assert plain_calls == [plain_runs] * 2  # one forward per run of the step
        assert ckpt_calls == [2 * ckpt_runs] * 2  # and one recomputation in every backward
        assert ckpt_bytes < 0.5 * plain_bytes, (ckpt_bytes, plain_bytes)


def _misuse(case):
    """Returns (error type, message, whether every shard is unchanged)."""
    c = comm()
    model = tiny_moe(checkpoint=case == "checkpoint-without-module") if case != "hf" else hf_model(
        "llama", checkpointing=False)
    units = fsdp.make_units(model, world_size=c.world_size)
    opt = rg.optim.adamw(1e-2, weight_decay=0.1)
    # from a module, fsdp.init leaves placeholders that raise on any value read; from its
    # state_dict the module keeps its own (stale) weights
    state = fsdp.init(units, model.state_dict() if case == "module-call" else model, opt, c)
    before = {k: v.data.clone() for k, v in state.shards.items()}
    if case in ("module-call", "module-call-released"):  # bypasses the params the step passes
        loss = lambda params, batch: cross_entropy(logits_of(model, batch[0]), batch[1])  # noqa: E731
    else:  # functional_call, while recomputation inside the model reads module attributes
        loss = lambda params, batch: cross_entropy(logits_of(model, batch[0], params), batch[1])  # noqa: E731
    step = fsdp.make_step(units, loss, opt, c)
    batch = (moe_batches if case != "hf" else lm_batches)(steps=1)[0]
    try:
        step(state, tuple(t[2 * c.rank: 2 * c.rank + 2] for t in batch))
    except rg.RaggedError as e:
        return type(e).__name__, str(e), all(torch.equal(state.shards[k].data, before[k]) for k in before)
    return None, "", False


@pytest.mark.parametrize("case", ["module-call", "module-call-released", "checkpoint-without-module", "hf"])
def test_misuse_is_refused_on_every_rank_before_any_change(workers2, case):
    fix = "torch.func.functional_call(model, params" if case == "module-call-released" else "make_step(..., module=model)"
    for kind, msg, unchanged in workers2.run(_misuse, case):
        assert kind is not None and unchanged, msg
        assert fix in msg, msg


def _built_apart(broadcast_from):
    """Each rank builds the model from its own seed: ``fsdp.init`` refuses (the message, and
    whether every parameter is still the module's own, unchanged), or with ``broadcast_from``
    trains from that rank's values."""
    c = comm()
    model = tiny_moe(seed=c.rank)
    if broadcast_from is not None:
        return train_sharded(c, model, moe_batches(steps=2), broadcast_from=broadcast_from)[0]
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    try:
        fsdp.init(fsdp.make_units(model, world_size=c.world_size), model, rg.optim.adamw(1e-2), c)
    except fsdp.ParamsMismatchError as e:
        return str(e), all(type(p) is torch.nn.Parameter and torch.equal(p, before[k]) for k, p in model.named_parameters())
    return None, False


def test_ranks_built_from_different_seeds_are_refused_on_every_rank_before_any_change(workers2):
    for msg, unchanged in workers2.run(_built_apart, None):
        assert msg is not None and unchanged, msg
        assert "different values for 'head.weight' (unit 'rest'): ranks [0] vs ranks [1]" in msg, msg
        assert "broadcast_from=0" in msg


def test_broadcast_from_one_rank_trains_like_torch_from_that_rank(workers2):
    ref = train_reference(tiny_moe(seed=1), moe_batches(steps=2))
    for r, params in enumerate(workers2.run(_built_apart, 1)):
        diff, where = max_diff(params, ref)
        assert diff <= 1e-10, f"rank {r}: {where} differs by {diff}"


def _init_apart(read_fails_on):
    """Rank ``read_fails_on`` passes a state dict that lacks a key; the other ranks' are whole:
    ``(error type, message)`` on each rank (with no fix, the whole ranks would wait for the other
    in the values check until gloo's timeout)."""
    c = comm()
    model = tiny_moe()
    units = fsdp.make_units(model, world_size=c.world_size)
    params = dict(model.state_dict())
    if c.rank == read_fails_on:
        del params["head.weight"]
    try:
        fsdp.init(units, params, rg.optim.adamw(1e-2), c)
    except rg.RaggedError as e:
        return type(e).__name__, str(e)
    return None, ""


def test_a_misuse_on_one_rank_in_init_raises_on_every_rank(workers2):
    (kind0, msg0), (kind1, msg1) = workers2.run(_init_apart, 1)
    assert kind1 == "RaggedKeyError" and "head.weight" in msg1, msg1
    assert kind0 == "RaggedError" and "fsdp.init failed on rank 1" in msg0 and "RaggedKeyError" in msg0, msg0


# ---- a rank's own error raised on every rank; settings that differ named (issue 45) -------------
def _mlp(c, opt, specs=None, **step_kw):
    """``(units, state, step, batch(k))``: a 2-layer MLP of 32 x 32 matrices on this rank."""
    import copy

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32)).double()
    units = fsdp.make_units(model, world_size=c.world_size, groups=["0", "2"], specs=specs)
    state = fsdp.init(units, model.state_dict(), opt, c)
    module = copy.deepcopy(model)
    loss = lambda params, batch: (module(batch) ** 2).mean()  # noqa: E731
    g = torch.Generator().manual_seed(1)
    data = torch.randn(8, 4, 32, generator=g, dtype=torch.float64)
    return units, state, lambda: fsdp.make_step(units, loss, opt, c, module=module, **step_kw), \
        lambda k: data[k][2 * c.rank: 2 * c.rank + 2]


def _outcome(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the rank catches its own error and goes on
        return type(e).__name__, str(e)
    return None, ""


def _rank_local_errors():
    """Rank 1 alone fails in each way below, catches its error and goes on; the last case trains
    on every rank: the comm is still usable. Without the agreement joining, rank 0 would wait in
    its step's agreement (or the checkpoint's first round) until a timeout."""
    c = comm()
    mine = c.rank == 1
    out = {}
    blocks = lambda name, t: rg.spec.Blocks(32, 32) if t.dim() == 2 else None  # noqa: E731
    fmt = (lambda leaf: "mxfp8") if mine else None  # a string, not a format
    units, state, make, batch = _mlp(c, rg.optim.adamw(1e-2), policy=fsdp.MixedPrecision(gather_format=fmt))
    out["format-string"] = _outcome(lambda: make()(state, batch(0)))
    fmt = (lambda leaf: rg.quant.mxfp8(block=32)) if mine else None  # for the 1-D biases too
    units, state, make, batch = _mlp(c, rg.optim.adamw(1e-2), policy=fsdp.MixedPrecision(gather_format=fmt))
    out["vector-format"] = _outcome(lambda: make()(state, batch(0)))
    units, state, make, batch = _mlp(c, rg.optim.adamw(1e-2), micro_batches=2)
    out["batch"] = _outcome(lambda: make()(state, batch(0)[:1] if mine else batch(0)))
    lr = lambda count: -1e-3 if mine and count >= 1 else 1e-3  # noqa: E731 - turns negative on rank 1 only
    units, state, make, batch = _mlp(c, rg.optim.soap(lr, precondition_frequency=2), specs=blocks)
    step = make()
    state, _ = step(state, batch(0))
    before = {k: v.data.clone() for k, v in state.shards.items()}
    out["schedule"] = _outcome(lambda: step(state, batch(1)))
    out["schedule-unchanged"] = all(torch.equal(state.shards[k].data, before[k]) for k in before), ""
    bad = {"step": object()} if mine else {"step": 1}
    path = os.path.join(tempfile.gettempdir(), "ragged-never-written")  # the same call on every rank
    out["save"] = _outcome(lambda: rg.checkpoint.save(path, {"shards": state.shards, **bad}, c))
    units, state, make, batch = _mlp(c, rg.optim.adamw(1e-2))
    out["trains"] = _outcome(lambda: make()(state, batch(0)))
    return out


def test_a_rank_local_error_raises_on_every_rank_and_the_comm_stays_usable(workers2):
    """make_step (a format callable that returns a string, or a format for a 1-D leaf, on rank 1
    only), a step's own checks (a batch that micro_batches=2 does not divide), a learning-rate
    schedule that turns negative on rank 1 only, a checkpoint's preparation (a leaf it cannot
    hold): rank 1 raises its error, rank 0 a RaggedError naming rank 1 and that error, at once."""
    r0, r1 = workers2.run(_rank_local_errors)
    said = {"format-string": ("RaggedTypeError", "fsdp.make_step failed on rank 1", "returned 'mxfp8'"),
            "vector-format": ("LayoutError", "fsdp.make_step failed on rank 1", "of shape (32,) is planned with Rows"),
            "batch": ("RaggedValueError", "rg.fsdp step failed on rank 1", "micro_batches=2"),
            "schedule": ("RaggedValueError", "rg.fsdp step failed on rank 1", "got -0.001 (its schedule's value at count 1)"),
            "save": ("RaggedTypeError", "failed on rank 1", "state['step'] is a object")}
    for case, (kind, where, what) in said.items():
        assert r1[case][0] == kind and what in r1[case][1], (case, r1[case])
        expected = "CheckpointError" if case == "save" else "RaggedError"
        assert r0[case][0] == expected and where in r0[case][1] and what in r0[case][1], (case, r0[case])
    assert r0["schedule-unchanged"][0] and r1["schedule-unchanged"][0]  # raised before any parameter changed
    assert r0["trains"] == r1["trains"] == (None, "")


def _settings_apart():
    """Each case: the ranks' steps differ in one setting; every rank raises, naming it."""
    c = comm()
    first = c.rank == 0
    blocks = lambda name, t: rg.spec.Blocks(32, 32) if t.dim() == 2 else None  # noqa: E731
    cases = {
        "gather_format": (rg.optim.adamw(1e-2), dict(policy=fsdp.MixedPrecision(
            gather_format=rg.quant.fp8(block=(32, 32)) if first else None))),
        "reduce_dtype": (rg.optim.adamw(1e-2), dict(policy=fsdp.MixedPrecision(
            reduce_dtype=torch.float32 if first else None))),
        "learning_rate": (rg.optim.soap(3e-3 if first else 3e-2), {}),
        "precondition_frequency": (rg.optim.soap(3e-3, precondition_frequency=10 if first else 20), {}),
        "negative everywhere": (rg.optim.adamw(lambda count: 1e-3 - 1e-3 * count), {}),  # < 0 from count 2
    }
    out = {}
    for name, (opt, kw) in cases.items():
        units, state, make, batch = _mlp(c, opt, specs=blocks, **kw)
        step = make()

        def train(state=state):
            for k in range(3):
                state, _ = step(state, batch(k))

        out[name] = _outcome(train)
    return out


def test_settings_that_differ_are_named_on_every_rank(workers2):
    """The step's agreement names the option or optimizer setting that differs, with each side's
    value; a schedule that turns negative on every rank alike raises on every rank too."""
    for r, out in enumerate(workers2.run(_settings_apart)):
        assert out["gather_format"][0] == "PlanMismatchError" and (
            "gather_format of unit '0': {['0.weight']: fp8(block=(32, 32))} on ranks [0] vs None on ranks [1]"
            in out["gather_format"][1]), out["gather_format"]
        assert "reduce_dtype: torch.float32 on ranks [0] vs None on ranks [1]" in out["reduce_dtype"][1], out
        assert "optimizer.learning_rate: 0.003 on ranks [0] vs 0.03 on ranks [1]" in out["learning_rate"][1], out
        assert "optimizer.precondition_frequency: 10 on ranks [0] vs 20 on ranks [1]" in out["precondition_frequency"][1]
        kind, msg = out["negative everywhere"]
        assert kind == "RaggedValueError" and "(its schedule's value at count 2)" in msg, (r, msg)


def _tiny_moe_step(loss=None, c=None):
    """``(comm, model, units, step, state, batches)`` for the tiny MoE on this rank (SGD); ``loss``
    defaults to the model through functional_call; ``batches(k)``: this rank's rows of k batches;
    ``c`` defaults to the module's shared comm."""
    c, model = c or comm(), tiny_moe()
    units = fsdp.make_units(model, world_size=c.world_size)
    opt = rg.optim.sgd(0.1)
    state = fsdp.init(units, model, opt, c)
    loss = loss or (lambda p, b: cross_entropy(logits_of(model, b[0], p), b[1]))
    batches = lambda k: [tuple(t[2 * c.rank: 2 * c.rank + 2] for t in b) for b in moe_batches(k)]  # noqa: E731
    return c, model, units, fsdp.make_step(units, loss, opt, c), state, batches


def _divergent():
    """Rank 1's loss reads, after the head, another unit on every call: no schedule covers it."""
    calls = [0]

    def loss(params, batch):
        out = cross_entropy(logits_of(model, batch[0], params), batch[1])
        if c.rank == 1:
            calls[0] += 1
            out = out + 0 * params[units[calls[0]].paths[0]].sum()
        return out

    c, model, units, step, state, batches = _tiny_moe_step(loss)
    try:
        for batch in batches(2):  # the first call learns; the second cannot
            state, _ = step(state, batch)
    except rg.PlanMismatchError as e:
        return str(e)
    return None


def test_data_dependent_collectives_raise_plan_mismatch_on_every_rank(workers2):
    msgs = workers2.run(_divergent)
    assert all(m is not None and "rank 1: unit " in m and "read in forward after entry" in m for m in msgs), msgs


def _one_rank_fails():
    def loss(params, batch):
        out = cross_entropy(logits_of(model, batch[0], params), batch[1])
        if c.rank == 0:
            raise ValueError("bad batch on rank 0")
        return out

    c, model, units, step, state, batches = _tiny_moe_step(loss)
    try:
        step(state, batches(1)[0])
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e)
    return None


def test_a_loss_failing_on_one_rank_raises_on_every_rank(workers2):
    (kind0, msg0), (kind1, msg1) = workers2.run(_one_rank_fails)
    assert (kind0, msg0) == ("ValueError", "bad batch on rank 0")
    assert kind1 == "RaggedError" and "rank 0: ValueError: bad batch on rank 0" in msg1


def _diverged_between_calls():
    """One rank issues a collective the other does not (another label) between two calls of the step
    (on a comm of its own: in NCCL's shape the ledger's periodic check poisons it)."""
    import torch.distributed as dist

    own = rg.collectives.from_torch(dist.new_group(list(range(dist.get_world_size()))), **transport_options())
    c, _, _, step, state, batches = _tiny_moe_step(c=own)
    (batch,) = batches(1)
    state, _ = step(state, batch)
    try:
        c.all_reduce(torch.ones(2), label=f"rank {c.rank}'s own reduction")
        step(state, batch)
    except rg.PlanMismatchError as e:
        return str(e)
    return None


def test_collectives_that_diverged_before_a_call_are_reported_by_then(workers2, transport):
    """gloo's headers raise at the diverging call itself; in NCCL's shape the ledger's digest, folded
    into the step's start-of-call agreement, names both sides (see [Note: what each agreement
    catches] in ragged/transforms/_check.py)."""
    msgs = workers2.run(_diverged_between_calls)
    for r, m in enumerate(msgs):
        assert m is not None and "rank 0's own reduction" in m and "rank 1's own reduction" in m, m
        assert transport == "gloo-default" or "checked late" in m, m


def _value_and_grad_vs_func_grad():
    c = comm()
    model = hf_model("llama", tied=True)
    units = fsdp.make_units(model, world_size=c.world_size)
    tokens, targets = lm_batches(steps=1)[0]
    params = {k: v.detach() for k, v in model.named_parameters()}
    loss_fn = lambda p, b: cross_entropy(logits_of(model, b[0], p), b[1])  # noqa: E731
    f = fsdp.value_and_grad(units, loss_fn, c, micro_batches=2)
    loss, grads = f(rg.shard(units, params, c), (tokens[2 * c.rank: 2 * c.rank + 2], targets[2 * c.rank: 2 * c.rank + 2]))
    full = rg.gather(units, grads, c)
    want = torch.func.grad(loss_fn)(params, (tokens, targets))
    return abs(loss - loss_fn(params, (tokens, targets)).item()), max_diff(full, want)


def test_value_and_grad_equals_func_grad_of_the_unsharded_loss(workers2):
    for loss_err, (diff, where) in workers2.run(_value_and_grad_vs_func_grad):
        assert loss_err < 1e-12 and diff < 1e-12, (loss_err, where, diff)
