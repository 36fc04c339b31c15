"""`python -m ragged plan` and `train` (in-process through main(), plus real subprocesses):
tables, honest fixes, one-line errors with exit status 2 for every bad value, defaults in
--help, progress lines and a verdict in a log."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

import ragged as rg
from ragged.__main__ import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(capsys, *argv):
    code = main(["plan", *argv, "--width", "200"])
    return code, capsys.readouterr().out


def test_plan_prints_a_table_per_unit_kind_and_the_whole_model(capsys):
    code, out = run(capsys, "--model", "gpt-oss-120b", "-m", "64", "256")
    assert code == 0
    for title in ("embed x1", "moe_layer x36", "head x1", "whole model"):
        assert title in out
    for col in ("ragged", "fsdp2", "fsdp1", "zero3", "megatron", "planner time"):
        assert col in out


def test_coarse_granules_are_explained_with_numbers(capsys):
    code, out = run(capsys, "--model", "gpt-oss-120b", "-m", "1024", "-g", "rows:128", "--max-buffers", "1")
    assert code == 0
    assert "warning: moe_layer at m=1024 with rows:128" in out
    assert "longer than 2*S" in out and "multiple of the lcm of their granules" in out
    assert "order-free lower bound" in out
    assert "would fix it (<= 3%): shard group 128 (8 replicas): 2.80%; 8 layers per unit: 2.80%" in out
    assert "would reduce it: granularity rows:1: 5.74%" in out


def _warnings(out):
    """``[(padding, [fix %], [reduction %])]`` of every warning the plan command printed."""
    found = []
    for block in out.split("warning: ")[1:]:
        padding = float(re.search(r"padding ([\d.]+)%", block).group(1))
        fixes = re.search(r"would fix it \(<= [\d.]+%\): (.*)", block)
        reductions = re.search(r"would reduce it: (.*)", block)
        found.append((padding, [float(x) for x in re.findall(r": ([\d.]+)%", fixes.group(1))] if fixes else [],
                      [float(x) for x in re.findall(r": ([\d.]+)%", reductions.group(1))] if reductions else []))
    return found


def test_suggested_fixes_are_verified_to_help(capsys):
    # DeepSeek-V3's dense layers at rows:1: 2 layers per unit plan to the same 81.15% at m=1024
    # (both layers force the same multiple), so that is no fix and is not offered there.
    code, out = run(capsys, "--model", "deepseek-v3-671b", "-m", "256", "1024", "-g", "rows:16", "--max-buffers", "1")
    assert code == 0
    found = _warnings(out)
    assert len(found) >= 3 and any(fixes for _, fixes, _ in found) and any(r for _, _, r in found)
    for padding, fixes, reductions in found:
        assert all(f <= 3.0 for f in fixes) and all(r < 0.9 * padding for r in reductions), (padding, fixes, reductions)
    code, out = run(capsys, "--model", "deepseek-v3-671b", "-m", "1024", "-g", "rows:1", "--max-buffers", "1")
    dense = out[out.index("warning: dense_layer"):].split("warning:")[1]
    assert "layers per unit" not in dense and "would fix it (<= 3%): shard group" in dense


def test_plan_shows_the_buffers_chosen_and_explains_each(capsys):
    code, out = run(capsys, "--model", "gpt-oss-120b", "-m", "1024", "-g", "rows:128")  # --max-buffers auto (default)
    assert code == 0 and "max buffers auto" in out and "buffers" in out
    assert "warning: moe_layer at m=1024 with rows:128: padding 22.45%" in out
    assert "why: buffer 0 (9 leaves, S_b=524288): 1 leaves longer than 2*S_b force S_b to a multiple of 524288" in out
    code, out = run(capsys, "--model", "deepseek-v3-671b", "-m", "256")
    assert "warning: dense_layer" not in out  # 0.19% with 3 buffers (35.86% with one)
    assert "must be 'auto' or a positive int" in refused(capsys, "plan", "--model", "gpt-oss-120b", "-m", "8",
                                                          "--max-buffers", "0")


def test_blocks_fall_back_where_tiles_cannot_apply(capsys):
    code, out = run(capsys, "--model", "gpt-oss-120b", "-m", "64", "-g", "blocks:128x128")
    assert code == 0
    assert "whole matrices Rows(2880)" in out and "1-D leaves use Rows(1)" in out


def test_user_shapes(capsys, tmp_path):
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"units": [{"name": "layers.{0..3}", "kind": "block", "params": {"w": [64, 32], "b": [32]}}]}))
    code, out = run(capsys, "--shapes", str(path), "-m", "8", "--strategy", "exact")
    assert code == 0 and "block x4" in out


def test_world_size_ranges(capsys):
    code, out = run(capsys, "--model", "llama3-70b", "-m", "8..32", "64")
    assert code == 0
    table = out[out.index("whole model"):]
    rows = [line.split("│")[1].strip() for line in table.splitlines() if line.startswith("│")]
    assert rows == ["8", "16", "32", "64"]


def refused(capsys, *argv):
    """Runs ``python -m ragged ARGV`` in-process; returns the one error line (exit status 2)."""
    with pytest.raises(SystemExit) as info:
        main(list(argv))
    captured = capsys.readouterr()
    assert info.value.code == 2, captured
    lines = captured.err.splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err and not captured.out, captured
    assert lines[0].startswith(f"python -m ragged {argv[0]}: error: ") and lines[0].endswith("--help)")
    return lines[0]


PLAN = ("plan", "--model", "llama3-70b", "-m", "8")


@pytest.mark.parametrize("argv, says", [
    (("plan", "--shapes", "/no/such.json", "-m", "8"), "no such file: '/no/such.json'"),
    ((*PLAN, "-g", "rows:x"), "not one of rows:N"),
    ((*PLAN, "-g", "rows:0"), "rows:N needs N >= 1"),
    ((*PLAN, "-g", "elements:-3"), "elements:N needs N >= 1"),
    ((*PLAN, "-g", "blocks:0x128"), "blocks:RxC needs R >= 1 and C >= 1"),
    (("plan", "--model", "llama3-70b", "-m", "0"), "must be a positive int"),
    (("plan", "--model", "llama3-70b", "-m", "64..8"), "1 <= A <= B"),
    ((*PLAN, "--align", "0"), "--align: must be >= 1, got 0"),
    ((*PLAN, "--layers-per-unit", "0"), "--layers-per-unit: must be >= 1, got 0"),
    ((*PLAN, "--warn-above", "-1"), "--warn-above: must be >= 0, got -1"),
    ((*PLAN, "--strategy", "best"), "invalid choice: 'best'"),
], ids=lambda v: " ".join(v) if isinstance(v, tuple) else None)
def test_bad_plan_values_are_one_line_and_exit_2(capsys, argv, says):
    assert says in refused(capsys, *argv)


def test_a_malformed_shapes_file_is_one_line(capsys, tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"units": []}')
    assert "non-empty 'units' list" in refused(capsys, "plan", "--shapes", str(path), "-m", "8")
    path.write_text("{not json")
    assert f"--shapes {path}" in refused(capsys, "plan", "--shapes", str(path), "-m", "8")


@pytest.mark.parametrize("argv, says", [
    (["--steps", "0"], "--steps: must be >= 1, got 0"),
    (["--steps", "abc"], "--steps: expected an integer, got 'abc'"),
    (["--batch", "0"], "--batch: must be >= 1, got 0"),
    (["--micro-batches", "0"], "--micro-batches: must be >= 1, got 0"),
    (["--nproc-per-node", "0"], "--nproc-per-node: must be >= 1, got 0"),
    (["--moe", "--top-k", "10"], "--top-k 10 is more than --experts 8"),
    (["--moe", "--experts", "0"], "--experts: must be >= 1, got 0"),
    (["--moe", "--experts", "2", "--top-k", "3"], "--top-k 3 is more than --experts 2"),
    (["--moe", "--layers", "1"], "--layers 1 has no 2nd block"),
    (["--experts", "4"], "add --moe"),
    (["--nproc-per-node", "3"], "--batch 32 must split into 3 ranks x 1 micro-batches (a multiple of 3); use --batch 30 or 33"),
    (["--micro-batches", "3"], "--batch 32 must split into 2 ranks x 3 micro-batches (a multiple of 6); use --batch 30 or 36"),
    (["--batch", "1"], "use --batch 2"),
    (["--dim", "130"], "--dim 130 must be a multiple of --heads 4"),
    (["--layers", "0"], "--layers: must be >= 1"),
    (["--vocab", "1"], "--vocab: must be >= 2"),
    (["--seq", "1"], "--seq: must be >= 2"),
    (["--lr", "0"], "--lr: must be > 0, got 0"),
    (["--lr", "nan"], "--lr: must be a finite number, got nan"),
    (["--warmup", "-1"], "--warmup: must be >= 0"),
    (["--weight-decay", "-0.1"], "--weight-decay: must be >= 0"),
    (["--clip", "-1"], "--clip: must be >= 0"),
    (["--log-every", "0"], "--log-every: must be >= 1"),
    (["--optimizer", "adam"], "invalid choice: 'adam'"),
    (["--json", "/no/such/dir/m.json"], "the directory /no/such/dir does not exist"),
    (["--hf", "llama", "--experts", "4"], "add --moe (or --hf mixtral), or drop them"),
    (["--hf", "mixtral", "--experts", "2", "--top-k", "4"], "--top-k 4 is more than --experts 2"),
    (["--hf", "llama", "--moe"], "with --hf llama drop it"),
    (["--hf", "mixtral", "--activation-checkpointing"], "not supported with --hf"),
    (["--save-pretrained", "out"], "add --hf llama|mixtral"),
    (["--hf", "llama", "--from-pretrained", "/no/such/dir"],
     "--from-pretrained /no/such/dir: '/no/such/dir' does not exist"),
    (["--hf", "llama", "--save-pretrained", "/dev/null/out"], "--save-pretrained /dev/null/out: /dev/null is a file"),
    (["--hf", "gpt2"], "invalid choice: 'gpt2'"),
    (["--gather-format", "fp4"], "invalid choice: 'fp4'"),
    (["--optimizer", "adamw_8bit", "--gather-format", "fp8"],
     "--gather-format fp8 quantizes 128 x 128 blocks, but --optimizer adamw_8bit plans blocks of 32 rows"),
    (["--optimizer", "soap", "--precondition-block", "64", "--reduce-format", "int8", "--gather-format", "fp8"],
     "use --gather-format int8 or mxfp8 (32 x 32, 1 x 32 blocks), or --precondition-block 128"),
    (["--checkpoint-dir", "ck", "--checkpoint-every", "0"], "--checkpoint-every: must be >= 1, got 0"),
    (["--checkpoint-dir", "ck", "--checkpoint-every", "5", "--keep", "0"], "--keep: must be >= 1, got 0"),
    (["--checkpoint-every", "5"], "--checkpoint-every and --keep apply to --checkpoint-dir DIR: add it"),
    (["--checkpoint-dir", "ck"], "--checkpoint-dir ck needs --checkpoint-every N"),
    (["--checkpoint-dir", "/dev/null", "--checkpoint-every", "5"], "--checkpoint-dir /dev/null: it exists and is not a directory"),
    (["--chunks", "4", "--nproc-per-node", "3"], "--chunks: chunks=4 at data-parallel world size W=3"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_bad_train_values_are_one_line_and_exit_2(capsys, argv, says):
    assert says in refused(capsys, "train", *argv)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_a_pretrained_directory_is_checked_before_any_rank_starts(capsys, tmp_path, monkeypatch):
    """Refused in this process, before any rank starts: an empty directory, one without config.json."""
    import torch.multiprocessing

    monkeypatch.setattr(torch.multiprocessing, "start_processes", None)  # starting a rank would fail loudly
    empty = refused(capsys, "train", "--hf", "llama", "--from-pretrained", str(tmp_path))
    assert "holds neither model.safetensors" in empty
    from ragged.checkpoint._safetensors import write_file

    write_file(str(tmp_path / "model.safetensors"), {"w": torch.zeros(2)})
    assert "has no config.json" in refused(capsys, "train", "--hf", "llama", "--from-pretrained", str(tmp_path))
    (tmp_path / "file").write_text("")
    assert "it exists and is not a directory" in refused(capsys, "train", "--hf", "llama", "--save-pretrained",
                                                         str(tmp_path / "file"))


@pytest.mark.parametrize("gather, reduce, optimizer", [("fp8", "mxfp8", "adamw"), ("int8", "none", "adamw_8bit"),
                                                       ("mxfp8", "fp8", "soap")])
def test_train_quantizes_the_collectives_it_is_asked_to(gather, reduce, optimizer):
    """--gather-format / --reduce-format reach the job's step (planned with the blocks they need, on
    the example GPT at its default sizes; built on meta and an abstract comm of 4 ranks): every
    128-column matrix is quantized, in the format asked for."""
    import ragged as rg
    from ragged import fsdp
    from ragged.examples._recipe import policy_for, specs_for
    from ragged.examples.gpt import GPT, GPTConfig
    from ragged.examples.train import build_parser, check_args

    args = build_parser().parse_args(["--gather-format", gather, "--reduce-format", reduce, "--optimizer", optimizer])
    check_args(args)
    model = GPT(GPTConfig(vocab_size=args.vocab, dim=args.dim, num_layers=2, num_heads=args.heads, ffn_dim=args.ffn,
                          max_seq_len=args.seq), device="meta")
    units = fsdp.make_units(model, world_size=4, specs=specs_for(args))
    step = fsdp.make_step(units, lambda params, batch: None, rg.optim.adamw(1e-3), rg.collectives.abstract(4),
                          policy=policy_for(args))
    for u, lay in zip(units, step.value_and_grad.layouts):
        for want, formats, plan in ((gather, lay.gather_formats, u.plan), (reduce, lay.reduce_formats, lay.grad_plan)):
            got = {leaf.path: formats[leaf.index] if formats else None for leaf in plan.leaves + plan.replicated}
            square = [p for p, leaf in zip(got, plan.leaves + plan.replicated) if leaf.shape == (128, 128)]
            assert square or u.name == "rest"
            assert all(type(got[p]).__name__ == ("NoneType" if want == "none" else "Format") for p in square), got
            assert all(want == "none" or repr(got[p]).startswith(want) for p in square), got


def test_a_checkpoint_dir_of_another_model_or_a_finished_job_is_refused_before_any_rank_starts(capsys, tmp_path,
                                                                                                  monkeypatch):
    """The newest checkpoint's job (its model options) is read in this process, before any rank starts."""
    import torch.multiprocessing

    from ragged.examples._train_checkpoint import _job
    from ragged.examples.train import build_parser, check_args

    monkeypatch.setattr(torch.multiprocessing, "start_processes", None)  # starting a rank would fail loudly
    args = build_parser().parse_args(["--dim", "64", "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "5"])
    check_args(args)
    job = json.dumps(_job(args), sort_keys=True)
    rg.checkpoint.save(str(tmp_path / "step-00000010"), {"step": 10, "job": job}, rg.checkpoint.SingleProcess())
    flags = ["train", "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "5"]
    assert ("step-00000010 is a checkpoint of another model (--dim 64 there, 128 here, --layers 4 there, 2 here); "
            "resume with the same options") in refused(capsys, *flags, "--layers", "2")
    assert "step-00000010 has done 10 steps, and --steps 10 asks for no more" in refused(capsys, *flags, "--dim", "64",
                                                                                            "--steps", "10")


def test_nccl_without_cuda_is_refused(capsys):
    assert "--backend nccl needs CUDA GPUs" in refused(capsys, "train", "--backend", "nccl")


@pytest.mark.parametrize("command, shown", [
    ("train", ["--steps STEPS         optimizer steps (default: 300)", "(default: 2)", "(default: 0.003)",
               "(default: adamw)", "(with --moe or --hf mixtral; default 8)",
               "(default: None, the master dtype fp32: with bf16 compute the same bits as --reduce-dtype fp32, not bf16)"]),
    ("plan", ["(default: rows:1)", "(default: dp)", "(default: bf16)", "(default: 3.0)"]),
])
def test_help_shows_the_defaults(capsys, command, shown):
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    text = re.sub(r"\s+", " ", capsys.readouterr().out)
    for piece in shown:
        assert re.sub(r"\s+", " ", piece) in text, piece


def _ragged(*argv, timeout=600):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "ragged", *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_a_bad_value_stops_before_any_process_starts():
    proc = _ragged("train", "--nproc-per-node", "3")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == ["python -m ragged train: error: --batch 32 must split into 3 ranks x 1 "
                                        "micro-batches (a multiple of 3); use --batch 30 or 33 (see python -m "
                                        "ragged train --help)"]


TINY = ("train", "--nproc-per-node", "2", "--layers", "2", "--dim", "32", "--ffn", "64", "--vocab", "64", "--seq", "32",
        "--batch", "8", "--warmup", "2")


@pytest.mark.slow
@pytest.mark.distributed
def test_in_a_log_progress_comes_as_plain_lines_and_a_verdict_ends_the_job():
    proc = _ragged(*TINY, "--steps", "16", "--lr", "1e-2", "--log-every", "4")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    steps = [int(m.group(1)) for m in (re.match(r"train step (\d+)/16  loss [\d.]+  ", l) for l in lines) if m]
    assert steps == [1, 4, 8, 12, 16]
    assert lines[-1].startswith("verdict: not learnt yet, loss ") and "fell but not below" in lines[-1]
    assert all(len(l) <= 200 for l in lines) and any(len(l) > 80 for l in lines)  # no cut at 80 columns


@pytest.mark.slow
@pytest.mark.distributed
def test_a_loss_that_does_not_fall_fails_the_job():
    proc = _ragged(*TINY, "--steps", "12", "--lr", "1e-9", "--quiet")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1].startswith("verdict: NOT LEARNT, the loss did not fall: loss ")
    assert "train step" not in proc.stdout  # --quiet


def test_version(capsys):
    import ragged

    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0 and capsys.readouterr().out == f"ragged {ragged.__version__} (torch {torch.__version__})\n"


@pytest.mark.slow
def test_module_entry_point_runs_and_a_pipe_keeps_every_digit():
    """stdout is a pipe (not a terminal) and COLUMNS narrow: rich alone cuts every table there."""
    from ragged import spec
    from ragged._cli import unit_specs
    from ragged._models import model_units

    env = dict(os.environ, COLUMNS="40")
    out = subprocess.run([sys.executable, "-m", "ragged", "plan", "--model", "llama3-70b", "-m", "8"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    assert "layer x80" in out.stdout and "…" not in out.stdout
    layer = next(u for u in model_units("llama3-70b", dtype=torch.bfloat16) if u.kind == "layer")
    plan = spec.make_plan(layer.params, unit_specs(layer.params, spec.Rows(1))[0], world_size=8,
                           max_buffers="auto")  # as the command plans it
    assert plan.shard_size > 10**8 and re.search(rf"│ +{plan.shard_size} │", out.stdout)
