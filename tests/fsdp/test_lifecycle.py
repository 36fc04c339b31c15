"""Model lifecycle on simulated ranks: ``fsdp.init`` from a module, a dict or a state dict; the
placeholders it leaves on the module; building on meta; ``fsdp.export`` back into modules."""

from __future__ import annotations

import copy
import gc
import re
import weakref

import pytest
import torch

import ragged as rg
from ragged import fsdp
from tests.fsdp._lifecycle_cases import Tiny, assert_state_dicts_equal, exported_init, meta_tiny, tiny

simulate = rg.collectives.simulate


def _shards(comm, units, params):
    state = fsdp.init(units, params, rg.optim.sgd(0.1), comm)
    return {k: (v.data.clone(), v.replicated.clone()) for k, v in state.shards.items()}


@pytest.mark.parametrize("world", [1, 2, 3])
def test_init_from_module_dict_and_state_dict_give_the_same_shards(world):
    model = tiny()
    units = fsdp.make_units(model, world_size=world)
    forms = {
        "dict": lambda: dict(model.named_parameters()),
        "state_dict": lambda: model.state_dict(),  # an OrderedDict with buffers and the tied alias
        "module": lambda: copy.deepcopy(model),
    }
    got = {}
    for name, form in forms.items():
        got[name] = simulate(world, lambda comm: _shards(comm, units, form()))
    for name in ("state_dict", "module"):
        for r in range(world):
            for unit, (data, rep) in got["dict"][r].items():
                assert torch.equal(got[name][r][unit][0], data) and torch.equal(got[name][r][unit][1], rep), (name, unit)


def test_pytree_units_accept_an_ordered_dict():
    from collections import OrderedDict

    tree = {"w": torch.randn(4, 3), "b": torch.randn(3)}
    units = fsdp.make_units(tree, world_size=2)
    a = simulate(2, lambda c: _shards(c, units, tree))
    b = simulate(2, lambda c: _shards(c, units, OrderedDict([("w", tree["w"]), ("b", tree["b"])])))
    assert all(torch.equal(a[r]["rest"][0], b[r]["rest"][0]) for r in range(2))


# ---- misuse ----------------------------------------------------------------------------------------------------


def _misuse_cases():
    model = tiny()
    units = fsdp.make_units(model, world_size=2)
    opt = rg.optim.sgd(0.1)
    missing = {k: v for k, v in model.state_dict().items() if k != "blocks.1.lin.weight"}
    tree_units = fsdp.make_units({"w": torch.ones(4)}, world_size=2)
    return {
        "units-and-model-swapped": (lambda c: fsdp.init(model, units, opt, c), rg.RaggedTypeError, "make_units"),
        "optimizer-not-a-transformation": (lambda c: fsdp.init(units, model, torch.optim.SGD, c), rg.RaggedTypeError,
                                           "GradientTransformation"),
        "wrong-world-size": (lambda c: fsdp.init(fsdp.make_units(model, world_size=3), model, opt, c),
                             rg.RaggedValueError, "world_size=comm.world_size"),
        "missing-key": (lambda c: fsdp.init(units, missing, opt, c), rg.RaggedKeyError, "'blocks.1.lin.weight'"),
        "list-of-tensors": (lambda c: fsdp.init(units, list(model.parameters()), opt, c), rg.RaggedTypeError,
                            "state_dict()"),
        "module-for-pytree-units": (lambda c: fsdp.init(tree_units, model, opt, c), rg.RaggedTypeError, "pytree"),
        "init-fn-for-real-weights": (lambda c: fsdp.init(units, model, opt, c, init_fn=lambda m: None),
                                     rg.RaggedValueError, "drop init_fn"),
        "device-for-real-weights": (lambda c: fsdp.init(units, model, opt, c, device="cpu"), rg.RaggedValueError,
                                    "drop device"),
        "meta-tensors-in-a-dict": (lambda c: fsdp.init(units, dict(meta_tiny().named_parameters()), opt, c),
                                   rg.RaggedValueError, "meta *module*"),
        "not-a-tensor": (lambda c: fsdp.init(units, {**model.state_dict(), "emb.weight": [1.0]}, opt, c),
                         rg.RaggedTypeError, "'emb.weight'"),
    }


@pytest.mark.parametrize("case", sorted(_misuse_cases()))
def test_misuse_raises_a_short_clear_error_on_every_rank(case):
    call, kind, needle = _misuse_cases()[case]

    def run(comm):
        try:
            call(comm)
        except rg.RaggedError as e:
            return type(e), str(e)
        return None, None

    for got_kind, msg in simulate(2, run):
        assert got_kind is not None and issubclass(got_kind, kind), (got_kind, msg)
        assert needle in msg and len(msg) < 400, msg


def test_init_twice_from_a_released_module_names_the_fix():
    model = tiny()
    units = fsdp.make_units(model, world_size=2)
    simulate(2, lambda c: fsdp.init(units, model, rg.optim.sgd(0.1), c))
    with pytest.raises(rg.RaggedValueError, match="already sharded"):
        simulate(2, lambda c: fsdp.init(units, model, rg.optim.sgd(0.1), c))


# ---- placeholders -----------------------------------------------------------------------------------------------


def test_init_leaves_placeholders_that_keep_metadata_and_ties():
    model = tiny()
    before = {n: (p.shape, p.dtype, p.requires_grad) for n, p in model.named_parameters(remove_duplicate=False)}
    units = fsdp.make_units(model, world_size=2)
    simulate(2, lambda c: fsdp.init(units, model, rg.optim.sgd(0.1), c))
    after = dict(model.named_parameters(remove_duplicate=False))
    assert list(after) == list(before)
    for n, p in after.items():
        assert isinstance(p, fsdp.Placeholder) and isinstance(p, torch.nn.Parameter)
        assert (p.shape, p.dtype, p.requires_grad) == before[n] and p.is_meta
    assert model.head.weight is model.emb.weight  # the tie survives
    assert model.head.weight.param_name == "emb.weight"
    assert fsdp.make_units(model, world_size=2) == units  # planning only reads metadata
    assert [b.device.type for b in model.buffers()] == ["cpu"] * 4  # buffers stay real
    clone = copy.deepcopy(model)
    assert isinstance(clone.head.weight, fsdp.Placeholder) and clone.head.weight is clone.emb.weight


@pytest.mark.filterwarnings("ignore:for .*copying from a non-meta parameter")  # load_state_dict warns, then raises
@pytest.mark.parametrize("use", ["forward", "state_dict", "to", "load_state_dict", "item", "grad"])
def test_placeholders_raise_a_clear_error_on_any_value_use(use):
    model = tiny()
    full = {k: v.clone() for k, v in model.state_dict().items()}
    units = fsdp.make_units(model, world_size=1)
    simulate(1, lambda c: fsdp.init(units, model, rg.optim.sgd(0.1), c))
    model.zero_grad()  # metadata only: fine
    calls = {
        "forward": lambda: model(torch.zeros(1, 3, dtype=torch.long)),
        "state_dict": lambda: model.state_dict(),
        "to": lambda: model.to(torch.float32),
        "load_state_dict": lambda: model.load_state_dict(full),  # copies into the parameters
        "item": lambda: model.blocks[0].lin.bias[0].item(),
        "grad": lambda: setattr(model.emb.weight, "grad", torch.zeros(11, 6)),
    }
    # load_state_dict wraps each copy's error in one RuntimeError
    with pytest.raises(RuntimeError if use == "load_state_dict" else fsdp.ShardedParameterError) as info:
        calls[use]()
    msg = str(info.value)
    assert isinstance(info.value, rg.RaggedError) or use == "load_state_dict"
    assert re.search(r"parameters? '[\w.]+'.* sharded by rg\.fsdp\.init", msg), msg
    assert "rg.fsdp.export" in msg and "functional_call" in msg


def test_functional_call_runs_on_a_released_module():
    model = tiny()
    x = torch.randint(0, 11, (2, 5))
    model.eval()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    expected = torch.func.functional_call(model, params, (x,))
    units = fsdp.make_units(model, world_size=2)
    simulate(2, lambda c: fsdp.init(units, model, rg.optim.sgd(0.1), c))
    got = torch.func.functional_call(model, params, (x,))  # the tied head follows emb.weight
    assert torch.equal(got, expected)
    assert isinstance(model.emb.weight, fsdp.Placeholder)  # swapped back


def test_init_frees_the_module_weights():
    """No full copy of the weights is left: the module's tensors are freed (nothing else holds
    them) and what the module still holds is buffers only; release_module=False keeps them."""
    for release, alive in ((True, False), (False, True)):
        model = Tiny(vocab=512, dim=64).to(torch.float64)
        refs = [weakref.ref(p) for p in model.parameters()]
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        units = fsdp.make_units(model, world_size=2)
        shard_bytes = simulate(2, lambda c: sum(
            d.data.numel() * d.data.element_size()
            for d in fsdp.init(units, model, rg.optim.sgd(0.1), c, release_module=release).shards.values()))
        gc.collect()
        assert all((r() is not None) == alive for r in refs)
        held = sum(p.untyped_storage().nbytes() for p in model.parameters() if not p.is_meta)
        assert held == (weight_bytes if alive else 0)
        assert max(shard_bytes) < 0.51 * weight_bytes + 1024  # each rank keeps about half


# ---- building on meta ---------------------------------------------------------------------------------------------


def test_meta_init_is_the_same_on_every_rank_world_size_and_grouping():
    w1 = simulate(1, lambda c: exported_init(c, meta_tiny()))[0]
    for world, groups in ((2, None), (3, None), (2, ["blocks"]), (4, ["emb", "blocks.0", "bn"])):
        model = meta_tiny()
        got = simulate(world, lambda c: exported_init(c, model, groups=groups))
        for r in range(world):
            assert_state_dicts_equal(got[r], w1)
    # real values: each module's reset_parameters ran (unit LayerNorms, BN stats, the buffer)
    ref = tiny()
    assert torch.equal(w1["blocks.0.norm.weight"], torch.ones(6, dtype=torch.float64))
    assert torch.equal(w1["bn.running_var"], ref.bn.running_var) and int(w1["bn.num_batches_tracked"]) == 0
    assert w1["head.weight"] is w1["emb.weight"]
    assert 0.5 < float(w1["emb.weight"].std()) < 1.5  # nn.Embedding: N(0, 1)
    bound = 1 / 6 ** 0.5  # nn.Linear: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    assert float(w1["blocks.1.lin.weight"].abs().max()) <= bound
    other_seed = simulate(1, lambda c: exported_init(c, meta_tiny(), seed=1))[0]
    assert not torch.equal(other_seed["blocks.0.lin.weight"], w1["blocks.0.lin.weight"])


def test_meta_init_holds_at_most_one_unit_real():
    with torch.device("meta"):
        model = torch.nn.ModuleDict({"blocks": torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))})
    units = fsdp.make_units(model, world_size=1)
    assert len(units) == 4
    scratch, alive = [], []

    def init_fn(module):  # bytes of earlier materialised storages still alive when the next module is made
        module.reset_parameters()
        gc.collect()
        alive.append(sum(r().nbytes() for r in scratch if r() is not None))
        scratch.extend(weakref.ref(p.untyped_storage()) for p in module.parameters(recurse=False))

    state = simulate(1, lambda c: fsdp.init(units, model, rg.optim.sgd(0.1), c, init_fn=init_fn))[0]
    assert len(alive) == 4 and max(alive) == 0  # the previous unit's tensors are gone when the next one is made
    assert all(r() is None for r in scratch) and all(d.data.numel() == 72 for d in state.shards.values())


def test_meta_init_sets_real_buffers_and_leaves_the_global_rng_alone():
    model = meta_tiny()
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    simulate(2, lambda c: exported_init(c, model))
    assert torch.equal(torch.random.get_rng_state(), state)
    assert torch.equal(model.rotary.inv_freq, tiny().rotary.inv_freq)  # computed, not garbage
    assert not any(b.is_meta for b in model.buffers())
    assert all(isinstance(p, fsdp.Placeholder) for p in model.parameters())


def test_meta_init_with_a_custom_init_fn():
    def init_fn(module):
        for p in module.parameters(recurse=False):
            torch.nn.init.constant_(p, 0.5)
        if isinstance(module, torch.nn.BatchNorm1d):
            module.reset_running_stats()
        if hasattr(module, "inv_freq"):
            module.reset_parameters()

    full = simulate(2, lambda c: exported_init(c, meta_tiny(), init_fn=init_fn))[0]
    assert all(bool((full[k] == 0.5).all()) for k in full if "bn.running" not in k and "num_batches" not in k)


def test_meta_init_refuses_what_the_init_leaves_unwritten():
    from ragged.examples.gpt import GPT, GPTConfig

    # the GPT's MoE holds raw nn.Parameters and has no reset_parameters
    gpt = GPT(GPTConfig(vocab_size=32, dim=16, num_layers=2, num_heads=2, ffn_dim=24, num_experts=2), device="meta")
    with pytest.raises(rg.RaggedValueError, match=r"'blocks\.1\.mlp\.w_down' \(module 'blocks\.1\.mlp', MoE\) was not "
                                                  r"initialised from meta.*init_fn"):
        simulate(2, lambda c: exported_init(c, gpt))

    def skip_rotary(module):
        if not hasattr(module, "inv_freq"):
            getattr(module, "reset_parameters", lambda: None)()

    with pytest.raises(rg.RaggedValueError, match=r"buffer 'rotary\.inv_freq' \(module 'rotary', Rotary\)"):
        simulate(1, lambda c: exported_init(c, meta_tiny(), init_fn=skip_rotary))

    def half(module):
        getattr(module, "reset_parameters", lambda: None)()
        if isinstance(module, torch.nn.Embedding):
            module.weight[:3] = float("nan")

    with pytest.raises(rg.RaggedValueError, match=r"'emb\.weight'.*18 of 66 elements were left unwritten"):
        simulate(1, lambda c: exported_init(c, meta_tiny(), init_fn=half))

    def replace(module):
        getattr(module, "reset_parameters", lambda: None)()
        if isinstance(module, torch.nn.Linear):
            module.weight = torch.nn.Parameter(torch.zeros(2))

    with pytest.raises(rg.RaggedValueError, match="do not assign new tensors"):
        simulate(1, lambda c: exported_init(c, meta_tiny(), init_fn=replace))


# ---- export ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_export_round_trips_strict_and_restores_the_module(tied):
    model = tiny(tied=tied)
    model.bn.running_mean.add_(0.25)  # a persistent buffer that differs from a fresh module's
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randint(0, 11, (2, 5))
    model.eval()
    expected = model(x)
    units = fsdp.make_units(model, world_size=2)

    def run(comm):
        state = fsdp.init(units, model, rg.optim.sgd(0.1), comm)
        return (fsdp.export(units, state.shards, comm, module=model),
                fsdp.export(units, state.shards, comm, module=model, rank0_only=False, dtype=torch.float32),
                fsdp.export(units, state.shards, comm))

    (full, every, bare), (none, every1, bare1) = simulate(2, run)
    assert none is None and bare1 is None
    assert list(full) == list(reference) and all(torch.equal(full[k], reference[k]) for k in full)
    assert (full["head.weight"] is full["emb.weight"]) == tied
    assert sorted(bare) == sorted(dict(model.named_parameters()) if not tied else
                                  [n for n in reference if n != "head.weight" and "bn.r" not in n and "num_b" not in n])
    assert every1["emb.weight"].dtype == torch.float32 and torch.equal(every1["emb.weight"], every["emb.weight"])
    assert every1["bn.num_batches_tracked"].dtype == torch.int64
    storages = {v.untyped_storage().data_ptr() for k, v in full.items() if k != "head.weight" or not tied}
    assert len(storages) == len(full) - tied  # one storage per tensor (safetensors / save_pretrained need it)

    fresh = Tiny(tied=tied).to(torch.float64)
    assert str(fresh.load_state_dict(full, strict=True)) == "<All keys matched successfully>"
    fresh.eval()
    assert torch.equal(fresh(x), expected)
    model.load_state_dict(full, assign=True)  # the released module gets real weights back
    if tied:
        model.head.weight = model.emb.weight
    assert not any(isinstance(p, fsdp.Placeholder) for p in model.parameters())
    assert torch.equal(model(x), expected)


def test_export_misuse():
    model = tiny()
    units = fsdp.make_units(model, world_size=1)

    def run(comm):
        state = fsdp.init(units, model, rg.optim.sgd(0.1), comm)
        errors = []
        for call in (lambda: fsdp.export(units, {}, comm),
                     lambda: fsdp.export(units, state.shards, comm, module=tiny(tied=False)),
                     lambda: fsdp.export(model, state.shards, comm)):
            try:
                call()
            except rg.RaggedError as e:
                errors.append(str(e))
        return errors

    errors = simulate(1, run)[0]
    assert len(errors) == 3
    assert "lacks units" in errors[0] and "'head.weight' of the module is in no unit" in errors[1]
    assert "make_units" in errors[2]
