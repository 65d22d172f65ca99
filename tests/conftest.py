"""Runs before any test module: `bridge.kernels` must decide on Triton's
interpreter before anything imports triton (Triton reads the switch at import)."""

import importlib.util

if importlib.util.find_spec("triton") and importlib.util.find_spec("torch"):
    import bridge.kernels  # noqa: F401

# Hypothesis profiles for tests/test_properties.py: "ci" (the default) is
# derandomized and bounded so the whole suite stays within CI's time;
# HYPOTHESIS_PROFILE=deep draws 50x the examples from fresh random seeds
# (before a release: README.md, "Hardening").
if importlib.util.find_spec("hypothesis"):
    import os

    from hypothesis import HealthCheck, settings

    _slow = [HealthCheck.too_slow, HealthCheck.data_too_large]
    settings.register_profile("ci", max_examples=100, derandomize=True, deadline=None,
                              database=None, print_blob=True, suppress_health_check=_slow)
    settings.register_profile("deep", max_examples=5000, deadline=None, database=None,
                              print_blob=True, suppress_health_check=_slow)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
