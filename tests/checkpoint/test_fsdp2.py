"""FSDP2 / torchtitan DCP checkpoints in one process (torch's own ``dcp.save`` / ``dcp.load`` with
``no_dist=True``, ragged on simulated ranks): torch.optim.AdamW -> ragged at W=3 -> torch continues
equal to torch alone (float64, a 3-D parameter among 2-D and 1-D ones), in FSDP2's nested layout and
torchtitan's (model keys at the top level, the optimizer state dict flattened); every bad checkpoint
is refused on every rank before any collective, with the key named."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

import ragged as rg
from ragged import fsdp
from ragged.checkpoint import CheckpointCorruptError, CheckpointMismatchError
from ragged.examples.data import rank_slice

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

LR, WD = 1e-2, 0.1


class Net(torch.nn.Module):
    def __init__(self, experts: int = 3):
        super().__init__()
        self.emb = torch.nn.Embedding(11, 6)
        self.experts = torch.nn.Parameter(torch.randn(experts, 6, 5) / 3)
        self.out = torch.nn.Linear(5, 11)

    def forward(self, tokens):
        h = torch.einsum("btd,edf->btf", self.emb(tokens), self.experts).tanh()
        return self.out(h)


def _net(**kw):
    torch.manual_seed(0)
    return Net(**kw).double()


def _batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 11, (6, 4), generator=g), torch.randint(0, 11, (6, 4), generator=g)


def _loss(logits, y):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def _torch_steps(model, opt, steps):
    for s in steps:
        opt.zero_grad()
        x, y = _batch(s)
        _loss(model(x), y).backward()
        opt.step()


LAYOUTS = {"fsdp2": dict(model_key="model", flatten=False), "torchtitan": dict(model_key="", flatten=True)}


def _torch_state(model, opt, layout):
    options = StateDictOptions(flatten_optimizer_state_dict=LAYOUTS[layout]["flatten"])
    ms, os_ = get_model_state_dict(model), get_optimizer_state_dict(model, opt, options=options)
    return ({"model": ms} if LAYOUTS[layout]["model_key"] else dict(ms)) | {"optimizer": os_}, options


def _torch_save(path, steps, layout="fsdp2", **adamw):
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), **({"lr": LR, "weight_decay": WD} | adamw))
    _torch_steps(model, opt, steps)
    dcp.save(_torch_state(model, opt, layout)[0], checkpoint_id=path, no_dist=True)
    return model


def _ragged(comm, src, out, steps, layout):
    model = _net()
    units = fsdp.make_units(model, world_size=comm.world_size, groups=["emb", "out"],
                            specs=lambda path, t: rg.spec.Elements(1))  # pieces start and end mid-row
    opt = rg.optim.adamw(LR, weight_decay=WD)
    state = fsdp.init(units, rg.checkpoint.fsdp2(src, model_key=LAYOUTS[layout]["model_key"]), opt, comm)
    loss = lambda p, b: _loss(torch.func.functional_call(model, p, (b[0],)), b[1])  # noqa: E731
    step = fsdp.make_step(units, loss, opt, comm)
    for s in steps:
        state, _ = step(state, rank_slice(_batch(s), comm.rank, comm.world_size))
    fsdp.save_fsdp2(units, state, comm, out, optimizer=opt, model_key=LAYOUTS[layout]["model_key"],
                    flatten_optimizer=LAYOUTS[layout]["flatten"])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_torch_to_ragged_to_torch_continues_like_torch_alone(tmp_path, layout):
    a, b = str(tmp_path / "torch"), str(tmp_path / "ragged")
    _torch_save(a, range(0, 2), layout)
    rg.collectives.simulate(3, lambda c: _ragged(c, a, b, range(2, 4), layout))
    model = Net().double()  # other values: every one must come from the checkpoint
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    sd, options = _torch_state(model, opt, layout)
    dcp.load(sd, checkpoint_id=b, no_dist=True)
    set_model_state_dict(model, sd["model"] if LAYOUTS[layout]["model_key"] else {k: v for k, v in sd.items()
                                                                                 if k != "optimizer"})
    set_optimizer_state_dict(model, opt, sd["optimizer"], options=options)
    assert all(s["step"].item() == 4 for s in opt.state.values())
    _torch_steps(model, opt, range(4, 6))
    ref = _net()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    _torch_steps(ref, ref_opt, range(6))
    diffs = {k: (v - dict(ref.named_parameters())[k]).abs().max().item() for k, v in model.named_parameters()}
    assert max(diffs.values()) < 1e-10, diffs
    moved = {k: (v - dict(_net().named_parameters())[k]).abs().max().item() for k, v in ref.named_parameters()}
    assert min(moved.values()) > 1e-3, moved  # six steps moved every parameter: the comparison can fail


def _refused(comm, path, model=None, opt=None, **kw):
    units = fsdp.make_units(model or _net(), world_size=comm.world_size, groups=["emb", "out"])
    try:
        fsdp.init(units, rg.checkpoint.fsdp2(path, **kw), opt or rg.optim.adamw(LR, weight_decay=WD), comm)
    except (CheckpointMismatchError, CheckpointCorruptError) as exc:
        return type(exc).__name__, str(exc)
    return None


def _sgd_dir(path):
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    _torch_steps(model, opt, range(1))
    dcp.save({"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)},
             checkpoint_id=path, no_dist=True)


BAD = {
    "missing-key": (None, None, "1 missing: 'extra'"),
    "shape": (dict(model=Net(experts=4).double()), None, "'model.experts' is (3, 6, 5), 'experts' is (4, 6, 5)"),
    "amsgrad": (dict(), dict(amsgrad=True), "'optimizer.state.emb.weight.max_exp_avg_sq': optimizer state "
                "'max_exp_avg_sq' is not AdamW's (exp_avg, exp_avg_sq, step) (AdamW with amsgrad=True"),
    "maximize": (dict(), dict(maximize=True), "(optimizer.param_groups.0.*) has {'maximize': True}: that is not "
                 "torch.optim.AdamW's update"),
    "lr": (dict(opt=rg.optim.adamw(2e-2, weight_decay=WD)), None, "has lr=0.01 (optimizer.param_groups.0.lr), the "
           "ragged optimizer lr=0.02"),
    "betas": (dict(opt=rg.optim.adamw(LR, b2=0.99, weight_decay=WD)), None, "has betas=(0.9, 0.999)"),
    "weight-decay": (dict(opt=rg.optim.adamw(LR)), None, "has weight_decay=0.1"),
    "not-adamw": (dict(opt=rg.optim.sgd(LR)), None, "the optimizer must be rg.optim.adamw"),
    "model-key": (dict(model_key="net"), None, "has no keys under 'net'"),
    "rename-clash": (dict(rename={"emb.weight": "out.weight"}), None,
                     "rename maps 'emb.weight' and 'out.weight' both to 'out.weight'."),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_checkpoint_refused_on_every_rank_naming_the_key(tmp_path, case):
    kw, adamw, text = BAD[case]
    path = str(tmp_path / "ckpt")
    _torch_save(path, range(1), **(adamw or {}))
    if case == "missing-key":
        model = _net()
        model.extra = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
        kw = dict(model=model)
    got = rg.collectives.simulate(2, lambda c: _refused(c, path, **kw))
    assert got[0] == got[1] and got[0] is not None, got
    assert text in got[0][1], got[0][1]


def test_sgd_state_is_not_adamw(tmp_path):
    path = str(tmp_path / "sgd")
    _sgd_dir(path)
    with pytest.raises(CheckpointMismatchError, match=r"'optimizer.state.emb.weight.momentum_buffer': optimizer state "
                                                      r"'momentum_buffer' is not AdamW's"):
        rg.checkpoint.fsdp2(path)
    assert rg.checkpoint.fsdp2(path, optimizer=False).moments is None  # the weights alone still load


class _Boom:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_metadata_that_runs_code_is_refused(tmp_path):
    path = tmp_path / "crafted"
    _torch_save(str(path), range(1))
    (path / ".metadata").write_bytes(pickle.dumps(_Boom()))
    with pytest.raises(CheckpointCorruptError, match="asks to load posix.system"):
        rg.checkpoint.fsdp2(path)


def _scheduled(comm, path):
    model = _net()
    units = fsdp.make_units(model, world_size=comm.world_size, groups=["emb", "out"])
    opt = rg.optim.adamw(lambda count: LR * 0.5 ** count.double(), weight_decay=WD)  # float64 like torch
    state = fsdp.init(units, rg.checkpoint.fsdp2(path), opt, comm)
    step = fsdp.make_step(units, lambda p, b: _loss(torch.func.functional_call(model, p, (b[0],)), b[1]), opt, comm)
    for s in range(2, 4):
        state, _ = step(state, rank_slice(_batch(s), comm.rank, comm.world_size))
    return fsdp.export(units, state.shards, comm)


def test_a_learning_rate_schedule_continues_from_the_step(tmp_path):
    """torch's LambdaLR leaves ``lr * f(step)`` in the group: a ragged schedule equal to it at the
    step is accepted and continues the run (and one that is not is refused)."""
    path = str(tmp_path / "ckpt")
    ref = _net()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.5 ** k)
    for s in range(4):
        _torch_steps(ref, opt, [s])
        sched.step()
        if s == 1:
            dcp.save({"model": get_model_state_dict(ref), "optimizer": get_optimizer_state_dict(ref, opt)},
                     checkpoint_id=path, no_dist=True)
    got = rg.collectives.simulate(2, lambda c: _scheduled(c, path))[0]
    diff = max((got[k] - v).abs().max().item() for k, v in ref.named_parameters())
    assert diff < 1e-10, diff
    wrong = rg.collectives.simulate(2, lambda c: _refused(c, path, opt=rg.optim.adamw(lambda count: LR * 0.4 ** count.double(),
                                                                                     weight_decay=WD)))
    assert "has lr=0.0025" in wrong[0][1] and "(its schedule at step 2)" in wrong[0][1], wrong[0][1]


class Tied(torch.nn.Module):
    """Tied embedding and head, and a persistent buffer: FSDP2's model state dict holds all three
    names (``emb.weight``, ``head.weight``, ``scale``), its optimizer state only ``emb.weight``."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(11, 6)
        self.head = torch.nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 6))

    def forward(self, tokens):
        return self.head(self.emb(tokens).tanh() * self.scale)


def _tied():
    torch.manual_seed(0)
    return Tied().double()


def _tied_ragged(comm, src, out):
    model = _tied()
    units = fsdp.make_units(model, world_size=comm.world_size, specs=lambda p, t: rg.spec.Elements(1))
    opt = rg.optim.adamw(LR, weight_decay=WD)
    ckpt = rg.checkpoint.fsdp2(src, rename={"head.weight": None, "scale": None})  # the alias, the buffer
    state = fsdp.init(units, ckpt, opt, comm)
    step = fsdp.make_step(units, lambda p, b: _loss(torch.func.functional_call(model, p, (b[0],)), b[1]), opt, comm)
    for s in range(2, 4):
        state, _ = step(state, rank_slice(_batch(s), comm.rank, comm.world_size))
    fsdp.save_fsdp2(units, state, comm, out, optimizer=opt, module=model)


def test_tied_weights_and_buffers_round_trip(tmp_path):
    a, b = str(tmp_path / "torch"), str(tmp_path / "ragged")
    model = _tied()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    _torch_steps(model, opt, range(2))
    sd = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)}
    assert sorted(sd["model"]) == ["emb.weight", "head.weight", "scale"] and list(sd["optimizer"]["state"]) == ["emb.weight"]
    dcp.save(sd, checkpoint_id=a, no_dist=True)
    with pytest.raises(CheckpointMismatchError, match=r"2 unexpected: 'model.scale', 'model.head.weight'. Fix: .* "
                                                     r"with rg.checkpoint.fsdp2\(path, rename="):
        rg.collectives.simulate(2, lambda c: fsdp.init(fsdp.make_units(_tied(), world_size=2), rg.checkpoint.fsdp2(a),
                                                       rg.optim.adamw(LR, weight_decay=WD), c))
    rg.collectives.simulate(3, lambda c: _tied_ragged(c, a, b))
    back = Tied().double()
    opt = torch.optim.AdamW(back.parameters(), lr=LR, weight_decay=WD)
    sd = {"model": get_model_state_dict(back), "optimizer": get_optimizer_state_dict(back, opt)}
    dcp.load(sd, checkpoint_id=b, no_dist=True)  # strict: every key of FSDP2's state dict is there
    set_model_state_dict(back, sd["model"])
    set_optimizer_state_dict(back, opt, sd["optimizer"])
    _torch_steps(back, opt, range(4, 6))
    ref = _tied()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    _torch_steps(ref, ref_opt, range(6))
    assert back.head.weight is back.emb.weight and torch.equal(back.scale, ref.scale)
    assert (back.emb.weight - ref.emb.weight).abs().max().item() < 1e-10


def test_optimizer_state_missing_for_a_parameter_is_refused(tmp_path):
    path = str(tmp_path / "partial")
    model = _net()
    opt = torch.optim.AdamW([p for n, p in model.named_parameters() if n != "out.bias"], lr=LR, weight_decay=WD)
    _torch_steps(model, opt, range(1))
    dcp.save({"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)},
             checkpoint_id=path, no_dist=True)
    got = rg.collectives.simulate(2, lambda c: _refused(c, path))
    assert got[0] == got[1] and "does not cover the units' parameters: missing ['out.bias']" in got[0][1], got
