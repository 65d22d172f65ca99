"""Runs before any test module: `bridge.kernels` must decide on Triton's
interpreter before anything imports triton (Triton reads the switch at import)."""

import importlib.util
import os

import pytest

# torch and JAX share a GPU in these tests, and pytest-xdist runs several processes on it:
# JAX must not take 75% of the device in each (its default), or torch runs out of memory.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# pytest-xdist runs one worker process per core and the tests' arrays are tiny: torch's
# OpenMP pool (a thread per core in every worker) only spins against the other workers.
# Set before anything imports torch.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # no compile-worker pool either

# The tests' arrays are tiny: XLA's CPU compiler spends most of a JAX test compiling.
# Level 0, without LLVM's expensive passes and with the loop emitters in place of the
# fusion emitters, keeps the semantics (no fast-math) and compiles several times faster;
# GLA_XLA_DEFAULT=1 keeps XLA's defaults (CI's slow step runs the JAX precision files so,
# as users' code compiles). Benchmarks never run under this file.
_FLAGS = os.environ.get("XLA_FLAGS", "")
if "xla_backend_optimization_level" not in _FLAGS and not os.environ.get("GLA_XLA_DEFAULT"):
    os.environ["XLA_FLAGS"] = (_FLAGS + " --xla_backend_optimization_level=0"
                               " --xla_llvm_disable_expensive_passes=true"
                               " --xla_cpu_use_fusion_emitters=false").strip()

if importlib.util.find_spec("triton") and importlib.util.find_spec("torch"):
    import bridge.kernels  # noqa: F401

# Hypothesis profiles for tests/test_properties.py: "ci" (the default) is
# derandomized and bounded so the whole suite stays within CI's time;
# HYPOTHESIS_PROFILE=deep draws 50x the examples from fresh random seeds
# (before a release: bridge/SPEC.md, "Property tests (hypothesis)").
if importlib.util.find_spec("hypothesis"):
    from hypothesis import HealthCheck, settings

    _slow = [HealthCheck.too_slow, HealthCheck.data_too_large]
    settings.register_profile("ci", max_examples=100, derandomize=True, deadline=None,
                              database=None, print_blob=True, suppress_health_check=_slow)
    settings.register_profile("deep", max_examples=5000, deadline=None, database=None,
                              print_blob=True, suppress_health_check=_slow)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_addoption(parser):
    parser.addoption("--backends", default=os.environ.get("GLA_BACKENDS", ""),
                     help="comma-separated parity backend names (e.g. torch-torch,jax-xla): "
                          "run only their tests marked `backend`, deselect the others' "
                          "(default: all, or the env var GLA_BACKENDS)")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: minutes on the CPU; deselected unless GLA_SLOW=1 "
                                       "(CI's slow step)")
    config.addinivalue_line("markers", "matrix: ahead-of-time builds that python -m "
                                       "parity.triton_matrix runs under every supported Triton; "
                                       "deselected unless GLA_MATRIX=1 (the matrix sets it)")
    config.addinivalue_line("markers", "backend(name): the test checks this parity backend "
                                       "(parity.backends); --backends selects by it")


def pytest_collection_modifyitems(config, items):
    tiers = [m for m, env in (("slow", "GLA_SLOW"), ("matrix", "GLA_MATRIX"))
             if os.environ.get(env, "") in ("", "0")]
    left = [it for it in items if any(it.get_closest_marker(m) for m in tiers)]
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = [it for it in items if it not in left]
    chosen = {n.strip() for n in config.getoption("backends").split(",") if n.strip()}
    if not chosen:
        return
    from parity import backends

    known = {b.name for b in backends.all_backends()[1:]}
    if chosen - known:
        raise pytest.UsageError(f"--backends / GLA_BACKENDS: unknown {sorted(chosen - known)}; "
                                f"the backends are {sorted(known)}")
    drop = [it for it in items
            if it.get_closest_marker("backend") and it.get_closest_marker("backend").args[0]
            not in chosen]
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = [it for it in items if it not in drop]
