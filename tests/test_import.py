"""``import ragged`` (and the parser of ``python -m ragged --help``) leave out what is imported when
used: torch.compile's dynamo and inductor, DTensor, torch.distributed.checkpoint, transformers.
The time it takes is a benchmark's (``bench/import_time.py``), not a test's."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAZY = ["torch._dynamo", "torch._inductor", "torch.distributed.tensor", "torch.distributed.checkpoint", "transformers"]
PROBE = f"""
import json, sys
import ragged
after_import = [m for m in {LAZY!r} if m in sys.modules]
from ragged.__main__ import build_parser
build_parser()
after_help = [m for m in {LAZY!r} if m in sys.modules]
print(json.dumps([after_import, after_help]))
"""


def test_import_ragged_leaves_out_what_is_imported_when_used():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    after_import, after_help = json.loads(out.stdout)
    assert after_import == [] and after_help == [], (after_import, after_help)


RACE = """
import ragged as rg
from ragged.examples import hf
def config(comm):  # 4 threads reach transformers' lazy attributes at once, in a process that never imported it
    return type(hf.config("llama", vocab_size=8, dim=8, layers=1, heads=2, ffn=8, seq=4)).__name__
print(rg.collectives.simulate(4, config))
"""


def test_optional_packages_import_safely_from_simulated_ranks():
    """Threads that import transformers lazily at once (the ranks of ``simulate``): each gets its
    class (before ``ragged._optional``, "module 'transformers' has no attribute 'LlamaConfig'" 4 runs
    out of 4 with transformers 5.25); see [Note: optional packages under simulate]."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", RACE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["['LlamaConfig',", "'LlamaConfig',", "'LlamaConfig',", "'LlamaConfig']"], out.stdout
