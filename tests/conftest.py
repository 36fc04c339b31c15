import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
    max_examples=60,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", deadline=None, max_examples=200)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# adamw_8bit's kernel="auto" runs eager torch ops in the suite (and in the processes it starts):
# compiling the fused update takes ~20-60 s per process on a small CPU. The compiled form is
# tested with kernel="compiled" in tests/optim/test_quant8.py.
os.environ.setdefault("RAGGED_QUANT8_KERNEL", "eager")

# Helper modules (``_util.py``, ``_harness.py``, ...) are imported by tests, not collected;
# --doctest-modules would otherwise import them under clashing top-level names.
collect_ignore_glob = ["*/_*.py"]
