"""The chunked XLA path (jax_side/xla.py) against the float64 NumPy oracle:
outputs, final states and every gradient, per SPEC feature and combined, under
jit (traced cu_seqlens / g_gamma, one compile per total length), vmap, checkpoint
and float64 finite differences."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

from bridge.contract import check  # noqa: E402
from jax_side.xla import recurrent_xla  # noqa: E402
from jax_cases import NAMES, make, run  # noqa: E402
from parity.oracle import recurrent, recurrent_grads  # noqa: E402

FP32_TOL = 1e-5  # relative norm; a step-by-step float32 scan lands around 1e-7..1e-6


def xla_run(x, cu=None, reverse=False, dtype=jnp.float32, chunk_size=64, cot=None, jit=True):
    """(o, final_state, grads) from the XLA path; activations cast to `dtype`."""
    return run(recurrent_xla, x, cu, reverse, dtype, cot, jit=jit, chunk_size=chunk_size)


def oracle_run(x, cu=None, reverse=False, cot=None, round_to=None):
    """Oracle outputs and gradients on the same (possibly bf16-rounded) values."""
    x = dict(x)
    if round_to is not None:
        for n in ("q", "k", "v"):
            x[n] = np.asarray(jnp.asarray(x[n], round_to).astype(jnp.float32))
    o, fs = recurrent(**x, reverse=reverse, cu_seqlens=cu)
    grads = None if cot is None else recurrent_grads(**x, reverse=reverse, cu_seqlens=cu, **cot)
    return o, fs, grads


def rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


def assert_matches(x, cu=None, reverse=False, tol=FP32_TOL, chunk_size=64, dtype=jnp.float32,
                   round_to=None):
    _, _, cot = make(**SHAPE_OF(x, cu))
    o, fs, grads = xla_run(x, cu, reverse, dtype=dtype, chunk_size=chunk_size, cot=cot)
    wo, wfs, wgrads = oracle_run(x, cu, reverse, cot, round_to)
    assert o.dtype == dtype and fs.dtype == jnp.float32
    assert np.isfinite(np.asarray(o, np.float32)).all() and np.isfinite(fs).all()
    errs = {"o": rel(o, wo), "final_state": rel(fs, wfs)}
    for n, gr in grads.items():
        assert gr.shape == np.shape(x[n]) and gr.dtype == (dtype if n in "qkv" else jnp.float32)
        assert np.isfinite(np.asarray(gr, np.float32)).all(), n
        errs["d" + n] = rel(gr, wgrads[n])
    assert max(errs.values()) <= tol, errs
    return errs


def SHAPE_OF(x, cu):
    """make() arguments that reproduce x's shapes (for the cotangents)."""
    B, T, H, K = x["q"].shape
    kw = dict(seed=99, B=B, T=T, H=H, Hk=x["k"].shape[2], K=K, V=x["v"].shape[-1])
    if cu is not None:
        kw["seqlens"] = tuple(np.diff(cu))
    return kw


FEATURES = {  # name: (make() arguments, reverse)
    "plain": (dict(), False),
    "g-head": (dict(g="head"), False),
    "g-key": (dict(g="key"), False),
    "gk": (dict(gk=True), False),
    "gv": (dict(gv=True), False),
    "gamma-head": (dict(gamma="head"), False),
    "initial-state": (dict(h0=True), False),
    "reverse": (dict(g="key", h0=True), True),
    "gqa": (dict(H=4, Hk=2, g="key", h0=True), False),
    "k-ne-v-odd": (dict(K=7, V=5, g="key", gv=True, h0=True), True),
    "t-not-multiple": (dict(T=75, g="head", gk=True), False),
    "all-gates-rev": (dict(T=70, g="key", gk=True, gv=True, gamma="head", h0=True), True),
}


@pytest.mark.parametrize("name", list(FEATURES))
def test_feature_matches_oracle(name):
    kw, reverse = FEATURES[name]
    x, cu, _ = make(**kw)
    assert_matches(x, cu, reverse, chunk_size=32)


VARLEN = (33, 0, 5, 16, 1, 40)  # ends mid-chunk, empty, shorter than a sub-chunk, exact


@pytest.mark.parametrize("kw, reverse", [
    (dict(g="key", h0=True), False),
    (dict(H=4, Hk=1, g="head", gk=True, gv=True, gamma="seq", h0=True), False),
    (dict(H=4, Hk=1, g="head", gk=True, gv=True, gamma="seq", h0=True), True),
    (dict(gamma="head", K=5, V=9), True),
], ids=["g-key", "everything", "everything-rev", "gamma-head-odd-rev"])
def test_varlen_matches_oracle(kw, reverse):
    x, cu, _ = make(seqlens=VARLEN, **kw)
    assert_matches(x, cu, reverse, chunk_size=16)


def test_default_chunk_multi_chunk():
    """The default 64-token chunks, several per sequence, with a partial last one."""
    x, _, _ = make(B=1, T=150, H=2, K=16, V=16, g="key", gv=True, gamma="head", h0=True)
    assert_matches(x)


@pytest.mark.parametrize("reverse", [False, True], ids=["fwd", "rev"])
def test_strong_gates_finite_and_match(reverse):
    """Log decays around -50 a step (cumulative sums far below float32's exp range)."""
    x, cu, _ = make(seqlens=(40, 7, 0, 29), g="key", gk=True, gv=True, gamma="seq", h0=True,
                    strength=40.0)
    x["g"][0, 10:30] = -80.0  # a run of extreme decays next to mild ones
    # gate gradients of such decays are sums of many cancelling terms: a little looser
    assert_matches(x, cu, reverse, chunk_size=32, tol=3e-5)


def test_bf16_inputs():
    """bf16 q/k/v (gates and state fp32): o comes back bf16, accumulation is fp32."""
    x, cu, _ = make(seqlens=(50, 3, 27), H=4, Hk=2, g="key", gv=True, gamma="head", h0=True)
    errs = assert_matches(x, cu, dtype=jnp.bfloat16, round_to=jnp.bfloat16, tol=1.5e-2,
                          chunk_size=32)
    assert errs["final_state"] < 1e-5  # fp32 accumulation of bf16-exact inputs


def test_jit_traced_cu_seqlens_and_gamma_one_compile():
    """cu_seqlens and g_gamma traced: two packings of the same total share one trace."""
    x, _, _ = make(seqlens=(20, 30, 14), g="key", gamma="seq", h0=True)
    traces = []

    def f(q, k, v, g, g_gamma, h0, cu):
        traces.append(1)
        plan = check(q, k, v, g=g, g_gamma=g_gamma, initial_state=h0, cu_seqlens=cu)
        return recurrent_xla(plan, q, k, v, g=g, g_gamma=g_gamma, initial_state=h0,
                             cu_seqlens=cu, chunk_size=16)

    jf = jax.jit(f)
    args = [x[n] for n in ("q", "k", "v", "g", "g_gamma", "initial_state")]
    for seqlens in ((20, 30, 14), (0, 61, 3)):
        cu = np.concatenate([[0], np.cumsum(seqlens)]).astype(np.int32)
        o, fs = jf(*args, jnp.asarray(cu))
        wo, wfs = recurrent(**x, cu_seqlens=cu)
        assert rel(o, wo) < FP32_TOL and rel(fs, wfs) < FP32_TOL
    assert len(traces) == 1
    assert jf._cache_size() == 1


def test_vmap_equals_loop():
    x, cu, _ = make(seqlens=(9, 0, 23), g="key", gv=True, gamma="seq", h0=True)
    x2, _, _ = make(seed=1, seqlens=(9, 0, 23), g="key", gv=True, gamma="seq", h0=True)
    names = list(x)
    plan = check(*(x[n] for n in ("q", "k", "v")), g=x["g"], gv=x["gv"],
                 g_gamma=x["g_gamma"], initial_state=x["initial_state"], cu_seqlens=cu)

    def f(q, k, v, g, gv, g_gamma, initial_state, cu):
        return recurrent_xla(plan, q, k, v, g=g, gv=gv, g_gamma=g_gamma,
                             initial_state=initial_state, cu_seqlens=cu, chunk_size=16)

    stacked = [jnp.stack([x[n], x2[n]]) for n in names]
    cus = jnp.stack([jnp.asarray(cu), jnp.asarray([0, 20, 20, 32], jnp.int32)])
    o, fs = jax.jit(jax.vmap(f))(*stacked, cus)
    for i, xi in enumerate((x, x2)):
        wo, wfs = recurrent(**xi, cu_seqlens=np.asarray(cus[i]))
        assert rel(o[i], wo) < FP32_TOL and rel(fs[i], wfs) < FP32_TOL


def test_checkpointed_grad_matches_oracle():
    x, cu, cot = make(seqlens=(21, 11), g="head", gk=True, h0=True)
    plan = check(x["q"], x["k"], x["v"], g=x["g"], gk=x["gk"], initial_state=x["initial_state"],
                 cu_seqlens=cu)

    @jax.checkpoint
    def loss(q, k, v, g, gk, h0):
        o, fs = recurrent_xla(plan, q, k, v, g=g, gk=gk, initial_state=h0,
                              cu_seqlens=jnp.asarray(cu), chunk_size=16)
        return jnp.sum(o * cot["do"]) + jnp.sum(fs * cot["dfinal_state"])

    names = ("q", "k", "v", "g", "gk", "initial_state")
    grads = jax.jit(jax.grad(loss, range(6)))(*(x[n] for n in names))
    want = recurrent_grads(**x, cu_seqlens=cu, **cot)
    for n, gr in zip(names, grads):
        assert rel(gr, want[n]) < FP32_TOL, n


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


def test_check_grads_float64(x64):
    """Finite differences in float64 through every floating input, forward and
    reverse mode, on a reversed varlen batch with an empty sequence."""
    from jax.test_util import check_grads

    x, cu, _ = make(seqlens=(5, 0, 19), H=2, Hk=1, K=3, V=2, g="head", gk=True, gv=True,
                    gamma="seq", h0=True)
    names = list(x)
    args = [jnp.asarray(x[n], jnp.float64) for n in names]
    plan = check(*args[:3], **dict(zip(names[3:], args[3:])), reverse=True, cu_seqlens=cu)

    def f(*a):
        return recurrent_xla(plan, *a[:3], **dict(zip(names[3:], a[3:])),
                             cu_seqlens=jnp.asarray(cu), chunk_size=16)

    o, fs = jax.jit(f)(*args)
    assert o.dtype == jnp.float64 and fs.dtype == jnp.float64
    wo, wfs = recurrent(**x, reverse=True, cu_seqlens=cu)
    assert rel(o, wo) < 1e-12 and rel(fs, wfs) < 1e-12
    check_grads(jax.jit(f), args, order=1, modes=("fwd", "rev"), atol=1e-6, rtol=1e-6)


def test_key_intra_vjp_finite_differences(x64):
    """The hand-written backward of the key-gate in-chunk tree (xla_intra) against
    float64 finite differences (reverse mode: it has no forward mode) and against
    JAX autodiff of the same tree, with mild and strong gates."""
    from jax.test_util import check_grads

    from jax_side.xla_decay import local
    from jax_side.xla_intra import key_intra, tree_p

    rng = np.random.default_rng(3)
    Z, C, K, V = 3, 32, 4, 3
    for strength in (1.0, 30.0):
        q, k = (jnp.asarray(rng.standard_normal((Z, C, K))) for _ in range(2))
        v = jnp.asarray(rng.standard_normal((Z, C, V)))
        a = jnp.asarray(-strength * np.logaddexp(0, -(rng.standard_normal((Z, C, K)) + 1.5)))
        check_grads(key_intra, (q, k, v, a), order=1, modes=("rev",), atol=1e-6, rtol=1e-6)
        do = jnp.asarray(rng.standard_normal((Z, C, V)))
        mine = jax.grad(lambda *x: jnp.sum(key_intra(*x) * do), range(4))(q, k, v, a)
        auto = jax.grad(lambda q, k, v, a: jnp.sum((tree_p(q, k, local(a)) @ v) * do),
                        range(4))(q, k, v, a)
        for m, w in zip(mine, auto):
            assert rel(m, w) < 1e-12


@pytest.mark.parametrize("reverse", [False, True], ids=["fwd", "rev"])
@pytest.mark.parametrize("chunk_size", [32, 64])
def test_key_gates_strong_custom_backward(reverse, chunk_size):
    """Key-dim gates without gv take the hand-written backward in float32: strong
    gates, a run of extreme decays, varlen with an empty sequence, GQA."""
    x, cu, _ = make(seqlens=(70, 7, 0, 50), H=4, Hk=2, g="key", gk=True, gamma="seq",
                    h0=True, strength=40.0)
    x["g"][0, 10:30] = -80.0
    assert_matches(x, cu, reverse, chunk_size=chunk_size, tol=3e-5)


def test_vmap_grad_key_gate():
    """vmap of the gradient through the custom backward equals the oracle per item."""
    xs = [make(seed=s, B=1, T=40, g="key", h0=True)[0] for s in (0, 1)]
    cot = make(seed=5, B=1, T=40)[2]
    names = ("q", "k", "v", "g", "initial_state")
    plan = check(*(xs[0][n] for n in ("q", "k", "v")), g=xs[0]["g"],
                 initial_state=xs[0]["initial_state"])

    def loss(q, k, v, g, h0):
        o, fs = recurrent_xla(plan, q, k, v, g=g, initial_state=h0, chunk_size=16)
        return jnp.sum(o * cot["do"]) + jnp.sum(fs * cot["dfinal_state"])

    stacked = [jnp.stack([x[n] for x in xs]) for n in names]
    grads = jax.jit(jax.vmap(jax.grad(loss, range(5))))(*stacked)
    for i, x in enumerate(xs):
        want = recurrent_grads(**x, **cot)
        for n, gr in zip(names, grads):
            assert rel(gr[i], want[n]) < FP32_TOL, n


@pytest.mark.parametrize("g,gk,gv,K,f64", [
    ("key", False, False, 3, False), ("none", True, False, 3, False),
    ("key", False, True, 3, False), ("key", False, False, 1, False),
    ("key", True, False, 3, True)])
def test_has_custom_vjp_is_where_forward_mode_fails(g, gk, gv, K, f64):
    """`has_custom_vjp(plan)` (what jax_side.recurrent uses to refuse forward mode
    with a clear error) says exactly when JAX cannot trace jax.jvp through the XLA
    path (eagerly: under an outer jit JAX raises only later, at lowering)."""
    from jax_side.xla import has_custom_vjp

    with jax.enable_x64(f64):
        x, _, _ = make(B=1, T=5, H=1, K=K, V=2, g=g, gk=gk, gv=gv)
        dt = jnp.float64 if f64 else jnp.float32
        x = {n: jnp.asarray(a, dt) for n, a in x.items()}
        plan = check(**x)
        f = lambda x: recurrent_xla(plan, **x)
        try:
            jax.jvp(f, (x,), (x,))
            failed = False
        except TypeError as e:
            assert "forward-mode" in str(e)
            failed = True
    assert failed == has_custom_vjp(plan)


@pytest.mark.parametrize("reverse,strength", [(False, 1.0), (True, 1.0), (False, 40.0)],
                         ids=["fwd", "rev", "strong"])
def test_streamed_forward_slabs_match_oracle(reverse, strength):
    """The forward without a backward (xla.streamed): several scan steps of two 16-token
    chunks, a partial last slab, GQA, per-sequence g_gamma and an initial state; strong
    gates (in-block sums past xla_intra.LIMIT) take the tree instead of block_p."""
    from jax_side.xla import streamed

    x, _, _ = make(B=2, T=75, H=4, Hk=2, g="key", gk=True, gamma="seq", h0=True,
                   strength=strength)
    if strength > 1:
        x["g"][0, 10:30] = -80.0
    names = [n for n in NAMES if n in x]
    arrs = {n: jnp.asarray(x[n]) for n in names}
    plan = check(**arrs, reverse=reverse)
    o, fs = jax.jit(lambda a: streamed(plan, **a, chunk_size=16, slab=2))(arrs)
    wo, wfs, _ = oracle_run(x, reverse=reverse)
    assert np.isfinite(o).all() and rel(o, wo) <= FP32_TOL and rel(fs, wfs) <= FP32_TOL


def test_forward_memory_is_output_plus_a_slab():
    """Compiled temporaries (XLA's memory analysis) of an undifferentiated forward: with
    its output under 3x the output (the issue-19 bound); the all-chunks forward it
    replaces needs many times more."""
    from jax_side.xla import all_chunks

    x, _, _ = make(B=1, T=4096, H=2, K=32, V=32, g="key")
    arrs = [jnp.asarray(x[n]) for n in ("q", "k", "v", "g")]
    plan = check(*arrs[:3], g=arrs[3])
    temp = lambda f: jax.jit(f).lower(*arrs).compile().memory_analysis().temp_size_in_bytes
    ours = temp(lambda q, k, v, g: recurrent_xla(plan, q, k, v, g=g))
    every_chunk = temp(lambda q, k, v, g: all_chunks(plan, q, k, v, g, None, None, None, None,
                                                   None, 64))
    out = 4096 * 2 * 32 * 4
    assert ours + out <= 3 * out and every_chunk >= 8 * out, (ours, every_chunk)


@pytest.mark.parametrize("T,reverse", [(1, False), (3, True)])
def test_decode_steps_match_oracle(T, reverse):
    """A few tokens a row (decoding) take the step-by-step update (xla.stepwise), value and
    gradients: every gate kind, GQA, per-sequence g_gamma, an initial state."""
    x, _, _ = make(B=2, T=T, H=4, Hk=2, K=5, V=3, g="key", gk=True, gv=True, gamma="seq",
                   h0=True)
    assert_matches(x, reverse=reverse)
    o, fs, _ = xla_run(x, reverse=reverse)  # the value without gradients
    wo, wfs, _ = oracle_run(x, reverse=reverse)
    assert rel(o, wo) <= FP32_TOL and rel(fs, wfs) <= FP32_TOL


SLABBED = {  # name: (make() arguments, reverse, chunk_size, BWD_CHUNK, tol)
    "key-h0": (dict(g="key", h0=True), False, 16, 32, FP32_TOL),
    "rev-gqa-gamma": (dict(H=4, Hk=2, g="head", gk=True, gamma="seq", h0=True), True, 32, 32,
                      FP32_TOL),
    "bwd-chunk-64": (dict(g="key", gamma="head", h0=True), True, 64, 64, FP32_TOL),
    "strong": (dict(g="key", gk=True, gamma="head", h0=True, strength=40.0), False, 32, 32,
               3e-5),
}


@pytest.mark.parametrize("name", list(SLABBED))
def test_slabbed_backward_crosses_slabs(monkeypatch, name):
    """Key-dim gates without gv or cu_seqlens, differentiated: the slab scan keeps only each
    slab's entering state and the backward recomputes the slabs in reverse (xla.Slabs).
    Slabs of two forward chunks, so T=150 spans several, the last one partial; the
    backward in chunks of BWD_CHUNK (32 and 64 tokens: other chunks than the forward's).
    Value and every gradient against the float64 oracle."""
    from jax_side import xla

    kw, reverse, chunk, bwd_chunk, tol = SLABBED[name]
    monkeypatch.setattr(xla, "SLAB_TOKENS", 2 * min(chunk, xla.STREAM_CHUNK))
    monkeypatch.setattr(xla, "BWD_CHUNK", bwd_chunk)
    x, _, _ = make(B=2, T=150, **kw)
    if kw.get("strength", 1.0) > 1:
        x["g"][0, 40:60] = -80.0  # a run of extreme decays across a slab boundary
    geo = xla.Slabs(check(*(x[n] for n in ("q", "k", "v")), reverse=reverse), chunk)
    assert geo.S >= 3 and geo.S * geo.W != 150 and geo.Cb == min(chunk, bwd_chunk)
    assert_matches(x, reverse=reverse, chunk_size=chunk, tol=tol)


def test_fwd_bwd_memory_is_bounded():
    """Compiled temporaries (XLA's memory analysis) of value and gradient: the forward's
    output, the slabs' entering states and one slab's work, under 2x the output
    (differentiating the all-chunks forward, what this replaced, needed 23x here)."""
    x, _, _ = make(B=1, T=4096, H=2, K=32, V=32, g="key")
    arrs = [jnp.asarray(x[n]) for n in ("q", "k", "v", "g")]
    plan = check(*arrs[:3], g=arrs[3])
    grad = jax.grad(lambda *a: jnp.sum(recurrent_xla(plan, *a[:3], g=a[3])[0]), range(4))
    temp = jax.jit(grad).lower(*arrs).compile().memory_analysis().temp_size_in_bytes
    out = 4096 * 2 * 32 * 4
    assert temp <= 2 * out, temp / out
