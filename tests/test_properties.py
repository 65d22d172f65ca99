"""Property-based parity: hypothesis draws whole problems (sizes down to 1 and
odd, every gate kind and combination, reverse, initial states, dtypes, packed
cu_seqlens with empty and one-token sequences) and every CPU backend must
match the float64 NumPy oracle in outputs, final state and every gradient.

Profiles (tests/conftest.py): "ci" (default) is derandomized; each backend
draws a share of its 100 examples by its cost (the Triton interpreter and
Pallas interpret mode are slow, and they get tiny shapes). `HYPOTHESIS_PROFILE=deep`
draws 50x as many from fresh seeds; `--backends a,b` (or GLA_BACKENDS=a,b)
runs only the named backends' tests. A shrunk failure becomes a regular case in
tests/test_edges.py. The draws include the extremes of the gates: entries of exactly -inf
and log decays of -100 to -1e6 a step. The slow tier (GLA_SLOW=1) draws the chunked
families' problems at sizes that cross their chunks, under each device's tiles.

On a CUDA device, `test_compiled_matches_oracle` draws the same problems at larger sizes
for each compiled Triton launch (both frameworks, every family) for a fixed time:
GLA_PROPERTY_SECONDS a backend (default 30), from hypothesis's seed (`--hypothesis-seed`),
each failing problem appended to the JSON-lines file GLA_PROPERTY_LOG (if set) the
moment it fails, so the last one written is the shrunk case (the GPU kit's correctness
step reads it: parity/gpu/correctness.py). Without a device it skips.
"""

import json
import os
import time

import pytest

pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import numpy as np  # noqa: E402

from bridge import tuning  # noqa: E402
from parity import backends, cases, compare  # noqa: E402

BACKENDS = {b.name: b for b in backends.all_backends()[1:]}

# (share of the profile's max_examples, largest T or sequence length, largest K/V,
# largest H). Shares measured to keep this file near 3 CPU-minutes in the ci profile.
BUDGET = {
    "torch-torch": (0.50, 40, 9, 6),
    "jax-xla": (0.08, 24, 9, 6),
    "torch-triton": (0.05, 4, 4, 4),
    "torch-triton-chunk": (0.02, 4, 4, 2),
    "jax-triton": (0.05, 4, 4, 4),
    "jax-triton-chunk": (0.02, 4, 4, 2),
    "jax-pallas": (0.03, 4, 4, 4),
    "torch-triton-fused-chunk": (0.02, 4, 4, 2),
    "jax-triton-fused-chunk": (0.02, 4, 4, 2),
}


# The compiled launches on a GPU: (largest T or sequence length, the K/V sizes drawn,
# largest H). K and V from a few sizes, odd ones among them, since each new size
# compiles every kernel afresh (~2 s each).
CUDA_SIZES = (160, (1, 7, 16, 64, 100, 128), 4)
CUDA_SECONDS = float(os.environ.get("GLA_PROPERTY_SECONDS", "30"))


@st.composite
def problems(draw, max_len, max_dim, max_heads):
    """(Case, dtype, seed, extreme): B, T, H, Hk, K, V from 1 (T, sequence lengths from
    0); K and V up to max_dim, or from max_dim's sizes when it is a tuple; `extreme` is
    applied to the gates by `with_extremes`."""
    Hk = draw(st.integers(1, 2))
    H = Hk * draw(st.integers(1, max(1, max_heads // Hk)))
    dim = st.sampled_from(max_dim) if isinstance(max_dim, tuple) else st.integers(1, max_dim)
    K, V = draw(dim), draw(dim)
    varlen = draw(st.booleans())
    if varlen:
        seqlens = tuple(draw(st.lists(st.integers(0, max_len), min_size=1, max_size=4)))
        B, T, packed = 1, sum(seqlens), draw(st.booleans())
    else:
        seqlens, packed = None, False
        B, T = draw(st.integers(1, 2)), draw(st.integers(0, max_len))
    case = cases.Case(
        "drawn", B=B, T=T, H=H, Hk=Hk, K=K, V=V,
        g=draw(st.sampled_from(["none", "head", "key"])), gk=draw(st.booleans()),
        gv=draw(st.booleans()), g_gamma=draw(st.sampled_from(["none", "head", "seq"])),
        initial_state=draw(st.booleans()), reverse=draw(st.booleans()), seqlens=seqlens,
        packed=packed, gate_scale=draw(st.sampled_from([0.3, 1.0, 3.0])),
        softmax_scale=draw(st.sampled_from([None, 0.7])))
    dtype = draw(st.sampled_from(["float32"] * 4 + ["bfloat16", "float16"]))
    extreme = draw(st.sampled_from(["none"] * 4 + ["reset", "far"]))
    return case, dtype, draw(st.integers(0, 2 ** 16)), extreme


def with_extremes(case, arrays, extreme, seed):
    """(case, arrays) with about a quarter of one gate's entries set to exactly -inf
    ("reset") or to log decays of -100 to -1e6 ("far"); "none" leaves them. The gate
    gradients there are ~0 (the oracle's exactly), which the chunked paths reach by
    cancelling O(1) terms: they are measured against an RMS floor of 0.1."""
    names = [n for n in ("g", "gk", "gv", "g_gamma") if n in arrays]
    if extreme == "none" or not names:
        return case, arrays
    rng = np.random.default_rng(seed)
    name = names[rng.integers(len(names))]
    gate = arrays[name].copy()
    hit = rng.random(gate.shape) < 0.25
    gate[hit] = -np.inf if extreme == "reset" else -np.exp(
        rng.uniform(np.log(100.0), np.log(1e6), int(hit.sum())))
    return case.with_(gate_grad_floor=0.1), dict(arrays, **{name: gate.astype(np.float32)})


def summed_gate_floors(case, arrays, dtype, want):
    """RMS floors for the gate gradients that sum the per-key one da [B,T,H,K] (the
    gradient of each key's log decay): a head gate's dg over K, dg_gamma over K and every
    token. Such a sum may cancel far below its terms; each term's rounding (float32's, or
    the 16-bit operands') then stays, absolute, about the dtype's error times ||da||, so
    the floor is ||da|| over the sum's entries. da is the oracle's dgk (with gk, or of an
    added zero gk)."""
    sums = [n for n, on in (("dg", case.g == "head"), ("dg_gamma", case.g_gamma != "none"))
            if on and n in want]
    if not sums:
        return {}
    if case.gk:
        da = want["dgk"]
    else:
        with_gk = dict(arrays, gk=np.zeros(arrays["q"].shape, np.float32))
        da = backends.Oracle().run(case.with_(gk=True), with_gk, dtype)["dgk"]
    return {n: float(np.linalg.norm(da)) / np.sqrt(want[n].size) for n in sums}


def check_backend(name, case, dtype, seed, extreme="none"):
    """The backend's outputs, final state and gradients against the oracle's."""
    case, arrays = with_extremes(case, backends.prepared(case, dtype, seed), extreme, seed)
    got = BACKENDS[name].run(case, arrays, dtype)
    want = backends.Oracle().run(case, arrays, dtype)
    errs = compare.errors(got, want, case.gate_grad_floor)
    for n, floor in summed_gate_floors(case, arrays, dtype, want).items():
        if n in got:
            errs[n] = compare.rel_err(got[n], want[n], max(floor, case.gate_grad_floor))
    bad = {k: e for k, e in errs.items() if not e <= compare.tolerance(dtype)}
    assert not bad, f"{case} {dtype} seed={seed} extreme={extreme}: {bad}"


def _property(name):
    share, max_len, max_dim, max_heads = BUDGET[name]

    @settings(max_examples=max(1, round(settings.default.max_examples * share)))
    @given(problem=problems(max_len, max_dim, max_heads))
    def test(problem):
        check_backend(name, *problem)

    test.__name__ = test.__qualname__ = "test_" + name.replace("-", "_") + "_matches_oracle"
    return pytest.mark.backend(name)(test)


# one test per backend, so each has its own example budget and report line
for _name in BUDGET:
    _test = _property(_name)
    globals()[_test.__name__] = _test


# The chunked families across their chunks on the interpreter (slow tier): the draws
# above stay inside one chunk; these cross chunks, key blocks and V blocks. fused_chunk
# runs each device's tiles (sm_80's mma.sync or sm_90's wgmma: fused_chunk.config),
# its sequences split into segments down to one chunk each (the split's min_chunks 1)
# where the device's SM count asks for it. (largest T or sequence length, the K/V sizes
# drawn, largest H); 12 examples a backend in the ci profile
ACROSS_SIZES = (100, (1, 5, 16, 33, 64, 100, 128), 4)
ACROSS_DEVICES = (("8.0 (sm_80's tiles)", None), ("8.0 (sm_80's tiles)", 108),
                  ("9.0 (sm_90's tiles)", None), ("9.0 (sm_90's tiles)", 132))
ACROSS = ("torch-triton-fused-chunk", "jax-triton-fused-chunk", "torch-triton-chunk",
          "jax-triton-chunk")


def _across(name):
    @pytest.mark.slow
    @pytest.mark.backend(name)
    @settings(max_examples=max(1, round(settings.default.max_examples * 0.12)))
    @given(problem=problems(*ACROSS_SIZES), device=st.sampled_from(ACROSS_DEVICES))
    def test(problem, device):
        with tuning.on_device(*device), tuning.overriding(
                {("fused_chunk", "split"): dict(min_chunks=1)}):
            check_backend(name, *problem)

    test.__name__ = test.__qualname__ = ("test_" + name.replace("-", "_")
                                         + "_across_chunks_matches_oracle")
    return test


for _name in ACROSS:
    _test = _across(_name)
    globals()[_test.__name__] = _test


def test_every_cpu_backend_is_drawn():
    """The budget names exactly the backends this project runs on CPU."""
    assert set(BUDGET) == set(BACKENDS)


# Shrunk examples, kept as regular cases.
# dg_gamma cancels: -0.095 from per-token gate gradients of RMS 0.26 (B=2, T=12); the
# chunked paths land 1-6e-5 from it relative to itself (the fused kernel 4e-7), which
# is float32 rounding of the summands, inside tolerance against their size.
_GAMMA_CANCEL = cases.Case("shrunk-gamma-cancel", B=2, T=12, H=1, Hk=1, K=6, V=4, g="head",
                           g_gamma="head", reverse=True, gate_scale=3.0, softmax_scale=0.7)
# dg of a head gate cancels: 0.0282 from per-key gate gradients of norm 0.29 (T = 1,
# K = 64, every gate, bf16); the chunked paths' 0.0292 (3.7% off, fused_chunk's with gv
# is the chunk family's backward) is 0.36% of that norm, the rounding of their 16-bit
# operands (their dgk within 0.56%).
_HEAD_CANCEL = cases.Case("shrunk-head-cancel", B=1, T=1, H=1, Hk=1, K=64, V=64, g="head",
                          gk=True, gv=True, g_gamma="seq", initial_state=True, reverse=True,
                          gate_scale=3.0, softmax_scale=0.7)
SHRUNK = ([(name, _GAMMA_CANCEL, "float32", 6149) for name in ("torch-torch", "jax-xla")]
          + [(name, _HEAD_CANCEL, "bfloat16", 1)
             for name in ("torch-triton-chunk", "torch-triton-fused-chunk")])


@pytest.mark.parametrize("name,case,dtype,seed",
                         [pytest.param(*x, marks=pytest.mark.backend(x[0])) for x in SHRUNK],
                         ids=[f"{n}-{c.name}" for n, c, _, _ in SHRUNK])
def test_shrunk_example(name, case, dtype, seed):
    check_backend(name, case, dtype, seed)


# ------------------------------------------------ the compiled launches, for a fixed time
COMPILED = [n for n in BUDGET if "triton" in n]


def timed_property(check, strategy, seconds, label, log_path=None):
    """Run `check(*problem)` on hypothesis draws from `strategy` until `seconds` have
    passed since the first (the draws left then are not checked), shrinking a failure as
    usual. Each failing problem is appended to `log_path` (JSON lines {label, problem,
    error}) when it fails, so the last one written is the shrunk case; a last line
    {label, checked, seconds, passed} follows. The number of examples checked."""
    state = {"start": None, "failed": False, "checked": 0}

    def log(**row):
        if log_path:
            with open(log_path, "a") as f:
                f.write(json.dumps(dict(label=label, **row), default=str) + "\n")

    @settings(max_examples=max(10, int(seconds * 10)), derandomize=False, deadline=None,
              database=None, print_blob=True, suppress_health_check=list(HealthCheck))
    @given(problem=strategy)
    def run(problem):
        now = time.monotonic()
        state["start"] = state["start"] or now
        if not state["failed"] and now - state["start"] > seconds:
            return
        try:
            check(*problem)
        except Exception as e:
            state["failed"] = True
            log(problem=repr(problem), error=f"{type(e).__name__}: {str(e)[:500]}")
            raise
        state["checked"] += 1

    t0 = time.monotonic()
    try:
        run()
    finally:
        log(checked=state["checked"], seconds=round(time.monotonic() - t0, 1),
            passed=not state["failed"])
    return state["checked"]


def _not_compiled():
    """Why the compiled launches cannot run here, or None."""
    import importlib.util

    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("triton") is None:
        return "torch or triton is not installed"
    import torch

    from bridge import kernels

    if not torch.cuda.is_available():
        return "no CUDA device: the compiled launches' properties run on a GPU (the GPU kit)"
    if kernels.INTERPRETED:
        return "TRITON_INTERPRET=1: the kernels are interpreted, not compiled"
    return None


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=[pytest.mark.backend(n), pytest.mark.skipif(
        _not_compiled() is not None, reason=str(_not_compiled()))]) for n in COMPILED])
def test_compiled_matches_oracle(name):
    """The compiled launch of `name` on CUDA, CUDA_SECONDS of draws at CUDA_SIZES."""
    checked = timed_property(lambda *p: check_backend(name, *p), problems(*CUDA_SIZES),
                             CUDA_SECONDS, name, os.environ.get("GLA_PROPERTY_LOG"))
    assert checked > 0


def test_timed_property_shrinks_and_logs_the_failure(tmp_path):
    """The runner itself, on a check that fails for T >= 3 (no kernel): the failure is
    shrunk to T == 3 and logged last; a passing check stops at its time."""
    log = tmp_path / "props.jsonl"

    def fails_from_3(case, dtype, seed, extreme):
        assert case.T < 3 or case.seqlens is not None, "T >= 3"

    with pytest.raises(AssertionError, match="T >= 3"):
        timed_property(fails_from_3, problems(8, 2, 2), 30.0, "fake", str(log))
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert rows[-1] == dict(label="fake", checked=rows[-1]["checked"],
                            seconds=rows[-1]["seconds"], passed=False)
    assert "T=3," in rows[-2]["problem"] and "seqlens=None" in rows[-2]["problem"]
    t0 = time.monotonic()
    assert timed_property(lambda *p: None, problems(8, 2, 2), 0.5, "quick") > 0
    assert time.monotonic() - t0 < 30
