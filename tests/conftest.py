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

# Helper modules (``_util.py``, ``_harness.py``, ...) are imported by tests, not collected;
# --doctest-modules would otherwise import them under clashing top-level names.
collect_ignore_glob = ["*/_*.py"]
