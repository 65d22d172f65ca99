"""Inputs at the extremes users hit (bridge/SPEC.md, "Edge inputs": extremes), on every
backend (the Triton families in the interpreter on the CPU, Pallas in interpret mode),
against the float64 oracle or a closed form:

- fp16 inputs whose true outputs exceed 65,504: fp32 accumulation, then the cast of
  `o` (and of each fp16 gradient) to fp16 gives +-inf exactly where the true value
  rounds past fp16's range, the fp32 result elsewhere; never NaN; the fp32 final state
  and gate gradients finite and exact.
- one-token sequences among long ones in one packed call, and 100,000 one-token
  sequences (the backends that are not interpreted: the Triton interpreter runs each
  (sequence, head) program in Python, ~0.13 s a one-token sequence forward+backward on
  the 2-core test machine, so 100,000 would take hours; it gets the 200-sequence case).
- cu_seqlens with repeated offsets (empty sequences) at the start, middle and end: an
  empty sequence returns its initial state, and passes dfinal_state to dinitial_state,
  exactly.
- T = 2^20 in one sequence (torch-native and XLA, tiny dims, against a closed form),
  and for the Triton families the launch grids of T = 2^20 and of 100,000 sequences x
  many heads within CUDA's limits, computed from the launch plans without running.

Gates of exactly -inf and decays far below -80 a step: tests/test_extreme_gates.py.
Cases marked `slow` run with GLA_SLOW=1 (tests/conftest.py)."""

import numpy as np
import pytest

from parity import backends, cases
from parity.compare import assert_close, errors, rel_err, tolerance

pytest.importorskip("torch")
pytest.importorskip("jax")

ALL = [b for b in backends.all_backends()[1:] if b.unavailable() is None]
ORACLE = backends.Oracle()
FP16_MAX_ROUNDED = 65520.0  # the smallest magnitude fp16 rounds to inf (65,504 + half an ulp)


def _interpreted(b) -> bool:
    """Slow on this machine: the Triton interpreter, or Pallas off a TPU."""
    if b.name == "jax-pallas":
        import jax

        return jax.default_backend() != "tpu"
    return b.interpreted


FAST = [b for b in ALL if not _interpreted(b)]
ids = lambda b: b.name  # noqa: E731


def _slow_if(cond):
    return [pytest.mark.slow] if cond else []


def each_direction(backends_, marks=lambda b: []):
    """(backend, reverse) params. By default: both directions of the backends not
    interpreted, the forward of the Triton families launched from torch; the rest (JAX's
    launches of the same kernels, Pallas interpret mode, the reverse direction) is slow:
    10 s to 2 minutes a call on the loaded 2-core machine."""
    def slow(b, rev):
        return _interpreted(b) and (rev or not b.name.startswith("torch-"))

    return [pytest.param(b, rev, marks=marks(b) + _slow_if(slow(b, rev)),
                         id=f"{b.name}-{'rev' if rev else 'fwd'}")
            for b in backends_ for rev in (False, True)]


def _oracle_errors(backend, case, arrays, dtype="float32"):
    got = backend.run(case, arrays, dtype)
    return errors(got, ORACLE.run(case, arrays, dtype), case.gate_grad_floor), got


# ------------------------------------------------------------------ (a) fp16 overflow
# k up to ~800 and v ramping to ~1,800 make S reach ~3e5: the late tokens' o and dq pass
# fp16's range, the early ones do not.
OVERFLOW = cases.Case("fp16-overflow", T=16, H=2, Hk=1, K=4, V=4, g="key", gv=True,
                      initial_state=True)
FP16_OUT = ("o", "dq", "dk", "dv")  # in q's, k's, v's dtype; the rest fp32


def _overflow_arrays(case):
    arrays = backends.prepared(case, "float16")
    ramp = np.geomspace(1.0, 600.0, case.T, dtype=np.float32)[None, :, None, None]
    arrays["k"] = backends.round_to(arrays["k"] * 200, "float16")
    arrays["v"] = backends.round_to(arrays["v"] * ramp, "float16")
    return arrays


# Over several 64-token chunks (the chunked families' per-chunk states): in processing
# order q and do start at 20 and 10,000 and fall, v rises from 1e-6 to 600, so the state
# passes 65,504 at the later chunks' starts (~9e5) and its gradient at an early chunk's
# end (~1e5), each where the other's factors are small (dq = S do and dk = dS v stay
# finite), while the products inside a chunk (scale q.k, do.v) stay below 65,504.
STATES = OVERFLOW.with_(name="fp16-overflow-states", T=300)
STATE_CHUNK = 64  # the chunked families' chunk (fused_chunk's 16 divides it)


def _state_overflow_arrays(case):
    arrays = backends.prepared(case, "float16", seed=19)  # (no true value at fp16's edge)

    def ramp(a, b, top):  # [1, T, 1, 1] in processing order: geometric a to b, clipped
        r = np.minimum(np.geomspace(a, b, case.T), top)
        return r[::-1 if case.reverse else 1].astype(np.float32)[None, :, None, None]

    for n, f in (("k", 200.0), ("v", ramp(1e-6, 1e7, 600)), ("q", ramp(1e3, 1, 20)),
                 ("do", ramp(1e8, 1e-7, 1e4))):
        arrays[n] = backends.round_to(arrays[n] * f, "float16")
    return arrays


def _span(case, arrays, lo, hi):
    """(case, arrays) of processing positions lo..hi-1 alone (case.reverse: token rows
    T-hi..T-lo-1, processed backwards)."""
    rows = slice(case.T - hi, case.T - lo) if case.reverse else slice(lo, hi)
    return case.with_(T=hi - lo), {n: a[:, rows] if n in ("q", "k", "v", "do", "g", "gv") else a
                                   for n, a in arrays.items()}


def _as_fp16(x):
    with np.errstate(over="ignore"):
        return np.asarray(x, np.float64).astype(np.float16).astype(np.float64)


def _check_fp16_overflow(got, want, tol=None):
    """fp16 outputs +-inf exactly where the float64 value rounds past 65,504 and within
    fp16's tolerance (or tol[name]) elsewhere; fp32 outputs finite and within it; no NaN."""
    tol = tol or {}
    assert set(got) == set(want)
    for n, w in want.items():
        g = np.asarray(got[n], np.float64)
        assert not np.isnan(g).any(), f"{n}: {np.isnan(g).sum()} NaN of {g.size}"
        if n not in FP16_OUT:  # fp32: finite, the oracle's within fp16 inputs' tolerance
            assert rel_err(g, w) <= tolerance("float16"), (n, rel_err(g, w))
            continue
        # no true value so near the rounding edge that fp32 rounding could cross it
        edge = np.abs(np.abs(w) / FP16_MAX_ROUNDED - 1) < 1e-3
        assert not edge.any(), f"{n}: the case has values at fp16's edge"
        w16 = _as_fp16(w)
        np.testing.assert_array_equal(np.isinf(g), np.isinf(w16), err_msg=n)
        np.testing.assert_array_equal(np.sign(g[np.isinf(g)]), np.sign(w16[np.isinf(w16)]))
        fin = np.isfinite(w16)
        bound = tol.get(n, tolerance("float16"))
        assert rel_err(g[fin], w[fin]) <= bound, (n, rel_err(g[fin], w[fin]))


@pytest.mark.parametrize("backend,reverse", each_direction(ALL))
def test_fp16_outputs_past_65504_are_inf_never_nan(backend, reverse):
    case = OVERFLOW.with_(reverse=reverse)
    arrays = _overflow_arrays(case)
    want = ORACLE.run(case, arrays, "float16")
    _check_fp16_overflow(backend.run(case, arrays, "float16"), want)
    # the case does what it says: o and dq overflow in part, o's early tokens do not
    assert 0 < np.isinf(_as_fp16(want["o"])).mean() < 1
    assert np.isinf(_as_fp16(want["dq"])).any()


def _states_params():
    """(backend, reverse, gv) params, with the value gate gv and without (fused_chunk
    runs its own backward only without: with gv, chunk's). By default the backends not
    interpreted with gv, and the torch forwards of chunk with gv and fused_chunk without;
    the rest is slow (interpreted: 15-45 s a call on the loaded 2-core machine)."""
    def default(b, rev, gv):
        if not _interpreted(b):
            return gv
        return not rev and (b.name, gv) in (("torch-triton-chunk", True),
                                             ("torch-triton-fused-chunk", False))

    return [pytest.param(b, rev, gv, marks=_slow_if(not default(b, rev, gv)),
                         id=f"{b.name}-{'rev' if rev else 'fwd'}-{'gv' if gv else 'no-gv'}")
            for b in ALL for rev in (False, True) for gv in (True, False)]


@pytest.mark.parametrize("backend,reverse,gv", _states_params())
def test_fp16_states_past_65504_at_chunk_boundaries(backend, reverse, gv):
    """The state and its gradient at 64-token chunk boundaries past fp16's range: the
    chunked families take them into products in fp32 (common.op_dot), not as fp16
    operands (inf there, then NaN in o, dq, dk, dv and the gate gradients: issue 43)."""
    case = STATES.with_(reverse=reverse, gv=gv)
    arrays = _state_overflow_arrays(case)
    want = ORACLE.run(case, arrays, "float16")
    # dv's finite values: 0.0031 on the chunked families in reverse with gv (the pair
    # terms inside a chunk, A^T do, cancel here; 0.0045 with A an fp16 operand)
    _check_fp16_overflow(backend.run(case, arrays, "float16"), want)
    # the case does what it says: the state passes 65,504 at a chunk start (the oracle's
    # final state of the chunks before it), its gradient at a chunk end (the initial-state
    # gradient of the chunks after it); o and dv overflow in part, dq and dk do not
    ends = range(STATE_CHUNK, case.T, STATE_CHUNK)
    assert max(np.abs(ORACLE.run(*_span(case, arrays, 0, e), "float16")["final_state"]).max()
               for e in ends) > FP16_MAX_ROUNDED
    assert max(np.abs(ORACLE.run(*_span(case, arrays, e, case.T), "float16")[
        "dinitial_state"]).max() for e in ends) > FP16_MAX_ROUNDED
    inf = {n: np.isinf(_as_fp16(want[n])).mean() for n in FP16_OUT}
    assert 0 < inf["o"] < 1 and 0 < inf["dv"] < 1 and inf["dq"] == inf["dk"] == 0, inf


# Inside one chunk (16 tokens: fused_chunk's and chunk's chunks hold them all): in
# processing order the first half's k (x200) meets the second half's q (x300), so the
# pair products scale q.k pass 65,504 (to ~1.6e5), and the second half's do (x5,000)
# meets v (x10), so do.v does too (to ~4e5); the first half's v (x0.01) keeps o finite
# (to ~1e4), and dq and dk overflow in part.
PAIRS = OVERFLOW.with_(name="fp16-overflow-pairs")


def _pair_overflow_arrays(case):
    arrays = backends.prepared(case, "float16")

    def step(first, second):  # [1, T, 1, 1] in processing order
        r = np.where(np.arange(case.T) < case.T // 2, first, second)
        return r[::-1 if case.reverse else 1].astype(np.float32)[None, :, None, None]

    for n, f in (("q", step(1, 300)), ("k", step(200, 1)), ("v", step(0.01, 10)),
                 ("do", step(1, 5000))):
        arrays[n] = backends.round_to(arrays[n] * f, "float16")
    return arrays


@pytest.mark.parametrize("backend,reverse", each_direction(ALL))
def test_fp16_pair_products_past_65504_inside_a_chunk(backend, reverse):
    """scale q.k and do.v past fp16's range inside a chunk: the chunked families take A
    and dA into products in fp32 (common.op_dot), not as fp16 operands (inf there, then
    o inf where it is finite and NaN in dq, dk, dv and the gate gradients: issue 43)."""
    case = PAIRS.with_(reverse=reverse)
    arrays = _pair_overflow_arrays(case)
    want = ORACLE.run(case, arrays, "float16")
    _check_fp16_overflow(backend.run(case, arrays, "float16"), want)
    # the case does what it says: both pair products pass 65,504, o does not, dq and dk
    # do in part
    q, k, v, do = (arrays[n].astype(np.float64) for n in ("q", "k", "v", "do"))
    k, v = (np.repeat(x, case.H // case.Hk, 2) for x in (k, v))
    assert np.abs(np.einsum("bthk,bshk->bhts", q, k)).max() * case.K ** -0.5 > 1e5
    assert np.abs(np.einsum("bthv,bshv->bhts", do, v)).max() > 1e5
    inf = {n: np.isinf(_as_fp16(want[n])).mean() for n in FP16_OUT}
    assert inf["o"] == 0 and 0 < inf["dq"] < 1 and 0 < inf["dk"] < 1, inf


# ------------------------------------------- (b) one-token sequences among long ones
def _mixed(n_seqs, long_lens, seed=0):
    lens = [1] * (n_seqs - len(long_lens)) + list(long_lens)
    np.random.default_rng(seed).shuffle(lens)
    return tuple(lens)


MIXED = cases.Case("mixed", H=2, Hk=1, K=4, V=4, g="key", gk=True, gv=True, g_gamma="seq",
                   initial_state=True, packed=True)
MIXED_SEQS = {"12-seqs": _mixed(12, (19, 23)), "200-seqs": _mixed(200, (40, 33, 64, 70))}


@pytest.mark.parametrize("backend,reverse", [
    pytest.param(*p.values, marks=_slow_if(_interpreted(p.values[0])), id=p.id)
    for p in each_direction(ALL)])
def test_one_token_sequences_in_a_long_packed_batch(backend, reverse):
    """200 sequences; 12 in the interpreter (slow: 30 s to 2 minutes a call here)."""
    size = "12-seqs" if _interpreted(backend) else "200-seqs"
    case = MIXED.with_(seqlens=MIXED_SEQS[size], reverse=reverse)
    assert_close(_oracle_errors(backend, case, backends.prepared(case, "float32"))[0])


# ------------------------------------------------ (c) 100,000 one-token sequences
def one_token_closed_form(x, scale):
    """Outputs and gradients of one-token sequences, packed [N, H, *] with H == Hk, gates
    g [N,H,K], gv [N,H,V], g_gamma [N,H], an initial state: each step is
    S = e^a h0 e^b + k^T v, o = scale q S, and for loss sum(o do) + sum(S dS) the state's
    cotangent D = scale q^T do + dS gives every gradient (float64)."""
    f = {n: np.asarray(a, np.float64) for n, a in x.items() if n != "cu_seqlens"}
    ea = np.exp(f["g"] + f["g_gamma"][..., None])
    eb = np.exp(f["gv"])
    kept = ea[..., :, None] * f["initial_state"] * eb[..., None, :]  # the decayed h0
    S = kept + f["k"][..., :, None] * f["v"][..., None, :]
    D = scale * f["q"][..., :, None] * f["do"][..., None, :] + f["dfinal_state"]
    M = D * kept
    return dict(o=scale * np.einsum("nhk,nhkv->nhv", f["q"], S), final_state=S,
                dq=scale * np.einsum("nhkv,nhv->nhk", S, f["do"]),
                dk=np.einsum("nhkv,nhv->nhk", D, f["v"]),
                dv=np.einsum("nhk,nhkv->nhv", f["k"], D),
                dinitial_state=ea[..., :, None] * D * eb[..., None, :],
                dg=M.sum(-1), dgv=M.sum(-2), dg_gamma=M.sum((-2, -1)))


def _one_token_case(n):
    return cases.Case("one-token", seqlens=(1,) * n, H=1, Hk=1, K=2, V=2, g="key", gv=True,
                      g_gamma="seq", initial_state=True, packed=True)


@pytest.mark.parametrize("backend", [
    pytest.param(b, marks=_slow_if(b.name != "torch-torch")) for b in FAST], ids=ids)
def test_100000_one_token_sequences(backend):
    """torch-native ~4 s; XLA ~50 s (slow: its compile grows with the offsets' count)."""
    case = _one_token_case(100_000)
    x = cases.inputs(case, 1)
    got = backend.run(case, x, "float32")
    want = one_token_closed_form(x, case.K ** -0.5)
    assert_close({n: rel_err(got[n], want[n]) for n in want})


# ---------------------------------------- (d) repeated offsets: empty sequences
EMPTY = cases.Case("empty-runs", seqlens=(0, 0, 6, 0, 0, 5, 0, 0), H=2, Hk=1, K=4, V=4,
                   g="head", gk=True, gv=True, g_gamma="seq", initial_state=True, packed=True)


@pytest.mark.parametrize("backend,reverse", each_direction(ALL))
def test_repeated_offsets_give_empty_sequences(backend, reverse):
    case = EMPTY.with_(reverse=reverse)
    arrays = backends.prepared(case, "float32")
    errs, got = _oracle_errors(backend, case, arrays)
    assert_close(errs)
    empty = [i for i, n in enumerate(case.seqlens) if n == 0]
    np.testing.assert_array_equal(got["final_state"][empty], arrays["initial_state"][empty])
    np.testing.assert_array_equal(got["dinitial_state"][empty], arrays["dfinal_state"][empty])
    assert np.all(got["dg_gamma"][empty] == 0)


# ----------------------------------------------- (e) T = 2^20 in one sequence
def constant_decay_closed_form(x, scale):
    """Outputs and gradients of B = H = Hk = 1 with only a constant decay g_gamma [1] and
    an initial state: S_t = e^c S_{t-1} + k_t^T v_t is a first-order linear filter over
    time (scipy's lfilter, float64), and so is the state's cotangent run backwards,
    D_t = scale q_t^T do_t + e^c D_{t+1} (+ dS at the last step)."""
    from scipy.signal import lfilter

    q, k, v, do = (np.asarray(x[n], np.float64)[0, :, 0] for n in ("q", "k", "v", "do"))
    T, K, V = q.shape[0], q.shape[1], v.shape[1]
    gamma = float(np.exp(np.float64(x["g_gamma"][0])))
    h0, dS = (np.asarray(x[n], np.float64).reshape(K * V)
              for n in ("initial_state", "dfinal_state"))

    def scan(inp, init):  # y_t = gamma y_{t-1} + inp_t, y_{-1} = init
        return lfilter([1.0], [1.0, -gamma], inp, axis=0, zi=gamma * init[None, :])[0]

    S = scan((k[:, :, None] * v[:, None, :]).reshape(T, K * V), h0).reshape(T, K, V)
    G = (scale * q[:, :, None] * do[:, None, :]).reshape(T, K * V)
    G[-1] += dS
    D = scan(G[::-1], np.zeros(K * V))[::-1].reshape(T, K, V)
    before = np.concatenate([h0.reshape(1, K, V), S[:-1]])
    lift = lambda a: a[None, :, None]  # noqa: E731  [T, *] -> [1, T, 1, *]
    return dict(o=lift(scale * np.einsum("tk,tkv->tv", q, S)), final_state=S[-1][None, None],
                dq=lift(scale * np.einsum("tkv,tv->tk", S, do)),
                dk=lift(np.einsum("tkv,tv->tk", D, v)), dv=lift(np.einsum("tk,tkv->tv", k, D)),
                dinitial_state=(gamma * D[0])[None, None],
                dg_gamma=np.array([gamma * np.sum(D * before)]))


def _long_case(T):
    return cases.Case("long", T=T, H=1, Hk=1, K=2, V=2, g_gamma="head", initial_state=True,
                      gamma_range=(0.01, 0.01))


@pytest.mark.parametrize("form,case", [
    (one_token_closed_form, _one_token_case(7).with_(H=2, Hk=2, K=3, V=4)),
    (constant_decay_closed_form, _long_case(50))], ids=["one-token", "constant-decay"])
def test_closed_form_is_the_oracle(form, case):
    """Each closed form above against the float64 oracle, every output and gradient."""
    x = cases.inputs(case, 3)
    want, got = ORACLE.run(case, x, "float32"), form(x, case.K ** -0.5)
    assert set(got) == set(want)
    for n in want:
        np.testing.assert_allclose(got[n], want[n], rtol=1e-10, atol=1e-12, err_msg=n)


@pytest.mark.parametrize("backend,T", [
    pytest.param(b, T, marks=_slow_if(T > 2 ** 16), id=f"{b.name}-{T}")
    for b in FAST for T in (2 ** 16, 2 ** 20)])
def test_one_long_sequence(backend, T):
    """T = 2^20: torch-native ~40 s, XLA ~15 s (slow); 2^16 in the default run."""
    case = _long_case(T)
    x = cases.inputs(case, 4)
    got = backend.run(case, x, "float32")
    want = constant_decay_closed_form(x, case.K ** -0.5)
    assert_close({n: rel_err(got[n], want[n]) for n in want})


# -------------------------------- launch grids within CUDA's limits, nothing launched
X_MAX, YZ_MAX = 2 ** 31 - 1, 65535


def _plan(B, T, H, N, K, V, varlen):
    from bridge.contract import Plan

    return Plan(B=B, T=T, H=H, Hk=H, K=K, V=V, N=N, g="key", gk=True, gv=True,
                g_gamma="seq" if varlen else "head", initial_state=True, scale=K ** -0.5,
                reverse=False, varlen=varlen, packed=varlen, dtype="bfloat16")


GRID_PLANS = {
    "T2^20-one-sequence": (1, 2 ** 20, 64, 1, 128, 128, False),
    "T2^20-x8-batch": (8, 2 ** 20, 16, 8, 64, 64, False),
    "100000-one-token-x64-heads": (1, 100_000, 64, 100_000, 128, 128, True),
    "100000-seqs-of-64-x128-heads": (1, 100_000 * 64, 128, 100_000, 64, 64, True),
    "batch-100000-one-token": (100_000, 1, 16, 100_000, 64, 64, False),
}


@pytest.mark.parametrize("mode", ["fused_recurrent", "chunk", "fused_chunk"])
@pytest.mark.parametrize("name", list(GRID_PLANS))
def test_launch_grids_within_cuda_limits(mode, name):
    """Forward and backward (with and without dfinal_state) of every Triton family:
    grid x <= 2^31 - 1, y and z <= 65,535, every axis >= 1."""
    from bridge.kernels import family

    fam, plan = family(mode), _plan(*GRID_PLANS[name])
    launches = list(fam.forward_launches(plan))
    for use_dht in (True, False):
        launches += fam.backward_launches(plan, use_dht)
    grids = [(l.kernel.__name__, tuple(int(a) for a in l.grid) + (1,) * (3 - len(l.grid)))
             for l in launches]
    bad = [(n, g) for n, g in grids
           if not (1 <= g[0] <= X_MAX and all(1 <= a <= YZ_MAX for a in g[1:]))]
    assert not bad, bad
    assert len(launches) >= 2
