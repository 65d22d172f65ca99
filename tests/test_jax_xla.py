"""The chunked XLA path (jax_side/xla.py) against the float64 NumPy oracle:
outputs, final states and every gradient, per SPEC feature and combined, under
jit, vmap, checkpoint and float64 finite differences. Inputs come from
`parity.cases`; runs and errors from `jax_cases`."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

from bridge.contract import check  # noqa: E402
from jax_side.xla import recurrent_xla  # noqa: E402
from jax_cases import bound, errors  # noqa: E402
from parity import backends, cases  # noqa: E402
from parity.compare import assert_close, rel_err  # noqa: E402

FP32_TOL = 1e-5  # relative norm; a step-by-step float32 scan lands around 1e-7..1e-6
ORACLE = backends.Oracle()
Case = cases.Case
BATCH = Case(B=2, T=40)  # the batched cases' default shape


def assert_matches(case, tol=FP32_TOL, fn=recurrent_xla, **kw):
    """Every quantity of `fn` (the XLA path) within `tol` of the oracle; `kw` go to
    `jax_cases.errors`. Returns the errors."""
    errs = errors(case, fn=fn, **kw)
    assert_close(errs, tol=tol)
    return errs


def extreme(case, rows):
    """The case's inputs (seed 0) with a run of extreme decays, -80 a step, at `rows`
    of g's first batch row, next to the case's milder ones."""
    arrays = cases.inputs(case)
    arrays["g"][0, rows] = -80.0
    return arrays


FEATURES = [
    BATCH.with_(name="plain"),
    BATCH.with_(name="g-head", g="head"),
    BATCH.with_(name="g-key", g="key"),
    BATCH.with_(name="gk", gk=True),
    BATCH.with_(name="gv", gv=True),
    BATCH.with_(name="gamma-head", g_gamma="head"),
    BATCH.with_(name="initial-state", initial_state=True),
    BATCH.with_(name="reverse", g="key", initial_state=True, reverse=True),
    BATCH.with_(name="gqa", H=4, Hk=2, g="key", initial_state=True),
    BATCH.with_(name="k-ne-v-odd", K=7, V=5, g="key", gv=True, initial_state=True,
                reverse=True),
    BATCH.with_(name="t-not-multiple", T=75, g="head", gk=True),
    BATCH.with_(name="all-gates-rev", T=70, g="key", gk=True, gv=True, g_gamma="head",
                initial_state=True, reverse=True),
]


@pytest.mark.parametrize("case", FEATURES, ids=lambda c: c.name)
def test_feature_matches_oracle(case):
    assert_matches(case, chunk_size=32)


VARLEN = (33, 0, 5, 16, 1, 40)  # ends mid-chunk, empty, shorter than a sub-chunk, exact
EVERYTHING = Case("everything", seqlens=VARLEN, H=4, Hk=1, g="head", gk=True, gv=True,
                  g_gamma="seq", initial_state=True)


@pytest.mark.parametrize("case", [
    Case("g-key", seqlens=VARLEN, g="key", initial_state=True),
    EVERYTHING,
    EVERYTHING.with_(name="everything-rev", reverse=True),
    Case("gamma-head-odd-rev", seqlens=VARLEN, g_gamma="head", K=5, V=9, reverse=True),
], ids=lambda c: c.name)
def test_varlen_matches_oracle(case):
    assert_matches(case, chunk_size=16)


def test_default_chunk_multi_chunk():
    """The default 64-token chunks, several per sequence, with a partial last one."""
    assert_matches(Case(T=150, K=16, V=16, g="key", gv=True, g_gamma="head",
                        initial_state=True))


@pytest.mark.parametrize("reverse", [False, True], ids=["fwd", "rev"])
def test_strong_gates_finite_and_match(reverse):
    """Log decays of up to -40 a step (cumulative sums far below float32's exp range)
    and a run of extreme ones next to them."""
    case = Case(seqlens=(40, 7, 0, 29), g="key", gk=True, gv=True, g_gamma="seq",
                initial_state=True, gate_scale=40.0, reverse=reverse)
    assert_matches(case, arrays=extreme(case, slice(10, 30)), chunk_size=32)


def test_bf16_inputs():
    """bf16 q/k/v (gates and state fp32): o comes back bf16, accumulation is fp32."""
    case = Case(seqlens=(50, 3, 27), H=4, Hk=2, g="key", gv=True, g_gamma="head",
                initial_state=True)
    errs = assert_matches(case, 1.5e-2, dtype=jnp.bfloat16, chunk_size=32)
    assert errs["final_state"] < 1e-5  # fp32 accumulation of bf16-exact inputs


def test_vmap_equals_loop():
    """vmap over inputs and traced cu_seqlens (two packings of one total) equals the
    oracle per item."""
    case = Case(seqlens=(9, 0, 23), g="key", gv=True, g_gamma="seq", initial_state=True)
    items = [(c, cases.inputs(c, seed)) for c, seed in ((case, 0),
                                                         (case.with_(seqlens=(20, 0, 12)), 1))]
    plan = check(**cases.call_kwargs(case, items[0][1]))

    def f(inputs, cu):
        return recurrent_xla(plan, **inputs, cu_seqlens=cu, chunk_size=16)

    stack = lambda n: jnp.stack([x[n] for _, x in items])
    names = [n for n in cases.INPUTS if n in items[0][1]]
    o, fs = jax.jit(jax.vmap(f))({n: stack(n) for n in names}, stack("cu_seqlens"))
    for i, (c, x) in enumerate(items):
        want = ORACLE.run(c, x, "float32")
        assert rel_err(o[i], want["o"]) < FP32_TOL
        assert rel_err(fs[i], want["final_state"]) < FP32_TOL


def checkpointed(plan, **kw):
    """recurrent_xla under jax.checkpoint: the backward recomputes its residuals."""
    return jax.checkpoint(lambda a: recurrent_xla(plan, **a, chunk_size=16))(kw)


def test_checkpointed_grad_matches_oracle():
    assert_matches(Case(seqlens=(21, 11), g="head", gk=True, initial_state=True),
                   fn=checkpointed)


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


def test_check_grads_float64(x64):
    """Finite differences in float64 through every floating input, forward and
    reverse mode, on a reversed varlen batch with an empty sequence."""
    from jax.test_util import check_grads

    case = Case(seqlens=(5, 0, 19), H=2, Hk=1, K=3, V=2, g="head", gk=True, gv=True,
                g_gamma="seq", initial_state=True, reverse=True)
    arrays = cases.cast(cases.inputs(case))
    f, inputs = bound(recurrent_xla, case, cases.to_jax(arrays), chunk_size=16)
    f = jax.jit(f)
    o, fs = f(inputs)
    assert o.dtype == jnp.float64 and fs.dtype == jnp.float64
    want = ORACLE.run(case, arrays, "float64")
    assert rel_err(o, want["o"]) < 1e-12 and rel_err(fs, want["final_state"]) < 1e-12
    check_grads(f, (inputs,), order=1, modes=("fwd", "rev"), atol=1e-6, rtol=1e-6)


def test_key_intra_vjp_finite_differences(x64):
    """The hand-written backward of the key-gate in-chunk tree (xla_intra) against
    float64 finite differences (reverse mode: it has no forward mode) and against
    JAX autodiff of the same tree, with mild gates (in-chunk log decays within
    xla_intra.LIMIT: block_p forward) and strong ones (far past it: the tree)."""
    from jax.test_util import check_grads

    from jax_side.xla_decay import local
    from jax_side.xla_intra import key_intra, tree_p

    for scale in (1.0, 30.0):  # chunks [Z=3, C=32, K=4] (one head), V=3
        _, x = cases.make(3, B=3, T=32, H=1, Hk=1, K=4, V=3, g="key", gate_scale=scale)
        q, k, v, a, do = (jnp.asarray(x[n][:, :, 0], jnp.float64)
                          for n in ("q", "k", "v", "g", "do"))
        check_grads(key_intra, (q, k, v, a), order=1, modes=("rev",), atol=1e-6, rtol=1e-6)
        mine = jax.grad(lambda *x: jnp.sum(key_intra(*x) * do), range(4))(q, k, v, a)
        auto = jax.grad(lambda q, k, v, a: jnp.sum((tree_p(q, k, local(a)) @ v) * do),
                        range(4))(q, k, v, a)
        for m, w in zip(mine, auto):
            assert rel_err(m, w) < 1e-12


def test_forward_weights_match_closed_form():
    """The forward's in-chunk weights P_ts = sum_d q_td k_sd e^{A_td - A_sd} (s <= t; A the
    in-chunk running sum of the gates) against that sum in float64 NumPy, in float32:
    in-chunk log decays just inside xla_intra.LIMIT (block_p: one matmul against the
    chunk start) and past it (forward_p falls back to the tree)."""
    from jax_side.xla_decay import local
    from jax_side.xla_intra import LIMIT, block_p, forward_p

    rng = np.random.default_rng(0)
    Z, C, K = 3, 32, 8
    q, k = (rng.standard_normal((Z, C, K)) for _ in range(2))
    for total in (0.95 * LIMIT, 3 * LIMIT):  # the largest |A_t| in the chunks
        a = -rng.uniform(0, 1, (Z, C, K))
        a *= total / np.abs(a.sum(1, keepdims=True)).max()
        A = np.cumsum(a, 1)
        want = np.einsum("ztd,zsd,ztsd->zts", q, k, np.exp(A[:, :, None] - A[:, None]))
        want *= np.tril(np.ones((C, C)))
        q32, k32, a32 = (jnp.asarray(x, jnp.float32) for x in (q, k, a))
        fns = [forward_p] + ([block_p] if total < LIMIT else [])
        for fn in fns:
            assert rel_err(jax.jit(fn)(q32, k32, local(a32)), want) < 2e-6, fn.__name__


@pytest.mark.parametrize("reverse", [False, True], ids=["fwd", "rev"])
@pytest.mark.parametrize("chunk_size", [32, 64])
def test_key_gates_strong_custom_backward(reverse, chunk_size):
    """Key-dim gates without gv take the hand-written backward in float32: strong
    gates, a run of extreme decays, varlen with an empty sequence, GQA."""
    case = Case(seqlens=(70, 7, 0, 50), H=4, Hk=2, g="key", gk=True, g_gamma="seq",
                initial_state=True, gate_scale=40.0, reverse=reverse)
    assert_matches(case, arrays=extreme(case, slice(10, 30)), chunk_size=chunk_size)


def test_vmap_grad_key_gate():
    """vmap of the gradient through the custom backward (each item its own inputs and
    cotangents) equals the oracle per item."""
    case = Case(T=40, g="key", initial_state=True)
    xs = [cases.inputs(case, s) for s in (0, 1)]
    f, inputs = bound(recurrent_xla, case, cases.to_jax(xs[0]), chunk_size=16)

    def loss(inputs, do, dfinal_state):
        o, fs = f(inputs)
        return jnp.sum(o * do) + jnp.sum(fs * dfinal_state)

    stack = lambda n: jnp.stack([x[n] for x in xs])
    grads = jax.jit(jax.vmap(jax.grad(loss)))({n: stack(n) for n in inputs}, stack("do"),
                                               stack("dfinal_state"))
    for i, x in enumerate(xs):
        want = ORACLE.run(case, x, "float32")
        for n, gr in grads.items():
            assert rel_err(gr[i], want["d" + n]) < FP32_TOL, n


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
        case, x = cases.make(T=5, H=1, Hk=1, K=K, V=2, g=g, gk=gk, gv=gv)
        x = cases.to_jax(cases.cast(x, np.float64 if f64 else np.float32))
        f, inputs = bound(recurrent_xla, case, x)
        try:
            jax.jvp(f, (inputs,), (inputs,))
            failed = False
        except TypeError as e:
            assert "forward-mode" in str(e)
            failed = True
    assert failed == has_custom_vjp(check(**inputs))


@pytest.mark.parametrize("reverse,scale", [(False, 1.0), (True, 1.0), (False, 40.0)],
                         ids=["fwd", "rev", "strong"])
def test_streamed_forward_slabs_match_oracle(reverse, scale):
    """The forward without a backward (xla.streamed): several scan steps of two 16-token
    chunks, a partial last slab, GQA, per-sequence g_gamma and an initial state; strong
    gates (in-chunk log decays past xla_intra.LIMIT) take the tree instead of block_p."""
    from jax_side.xla import XlaConfig, streamed

    case = Case(B=2, T=75, H=4, Hk=2, g="key", gk=True, g_gamma="seq", initial_state=True,
                gate_scale=scale, reverse=reverse)
    arrays = extreme(case, slice(10, 30)) if scale > 1 else None
    assert_close(errors(case, fn=streamed, grads=False, arrays=arrays, chunk_size=16,
                        config=XlaConfig(slab_tokens=2 * 16)),
                 tol=FP32_TOL)


def test_forward_memory_is_output_plus_a_slab():
    """Compiled temporaries (XLA's memory analysis) of an undifferentiated forward: with
    its output under 3x the output (the issue-19 bound); the all-chunks forward it
    replaces needs many times more."""
    from jax_side.xla import all_chunks

    case, x = cases.make(T=4096, K=32, V=32, g="key")
    f, inputs = bound(recurrent_xla, case, cases.to_jax(x))
    plan = check(**inputs)
    temp = lambda f: jax.jit(f).lower(inputs).compile().memory_analysis().temp_size_in_bytes
    ours = temp(f)
    every_chunk = temp(lambda a: all_chunks(plan, a["q"], a["k"], a["v"], a["g"], None, None,
                                            None, None, None, 64))
    out = 4096 * 2 * 32 * 4
    assert ours + out <= 3 * out and every_chunk >= 8 * out, (ours, every_chunk)


@pytest.mark.parametrize("T,reverse", [(1, False), (3, True)])
def test_decode_steps_match_oracle(T, reverse):
    """A few tokens a row (decoding) take the step-by-step update (xla.stepwise), value and
    gradients: every gate kind, GQA, per-sequence g_gamma, an initial state."""
    case = Case(B=2, T=T, H=4, Hk=2, K=5, V=3, g="key", gk=True, gv=True, g_gamma="seq",
                initial_state=True, reverse=reverse)
    assert_matches(case)
    assert_matches(case, grads=False)  # the value without gradients


SLABBED = {  # name: (case, chunk_size, the backward's chunk, tol)
    "key-h0": (BATCH.with_(g="key", initial_state=True), 16, 32, FP32_TOL),
    "rev-gqa-gamma": (BATCH.with_(H=4, Hk=2, g="head", gk=True, g_gamma="seq",
                                  initial_state=True, reverse=True), 32, 32, FP32_TOL),
    "bwd-chunk-64": (BATCH.with_(g="key", g_gamma="head", initial_state=True, reverse=True),
                     64, 64, FP32_TOL),
    "strong": (BATCH.with_(g="key", gk=True, g_gamma="head", initial_state=True,
                           gate_scale=40.0), 32, 32, FP32_TOL),
}


@pytest.mark.parametrize("name", list(SLABBED))
def test_slabbed_backward_crosses_slabs(name):
    """Key-dim gates without gv or cu_seqlens, differentiated: the slab scan keeps only each
    slab's entering state and the backward recomputes the slabs in reverse (xla.Slabs).
    Slabs of two forward chunks, so T=150 spans several, the last one partial; the
    backward in chunks of bwd_chunk (32 and 64 tokens: other chunks than the forward's).
    Value and every gradient against the float64 oracle."""
    from jax_side import xla

    case, chunk, bwd_chunk, tol = SLABBED[name]
    case = case.with_(T=150)
    config = xla.XlaConfig(slab_tokens=2 * min(chunk, xla.DEFAULT.stream_chunk),
                           bwd_chunk=bwd_chunk)
    # strong: a run of extreme decays across a slab boundary
    arrays = extreme(case, slice(40, 60)) if case.gate_scale > 1 else cases.inputs(case)
    geo = xla.Slabs(check(**cases.call_kwargs(case, arrays)), chunk, config)
    assert geo.S >= 3 and geo.S * geo.W != 150 and geo.Cb == min(chunk, bwd_chunk)
    assert_matches(case, tol, arrays=arrays, chunk_size=chunk, config=config)


def test_fwd_bwd_memory_is_bounded():
    """Compiled temporaries (XLA's memory analysis) of value and gradient: the forward's
    output, the slabs' entering states and one slab's work, under 2x the output
    (differentiating the all-chunks forward, what this replaced, needed 23x here)."""
    case, x = cases.make(T=4096, K=32, V=32, g="key")
    f, inputs = bound(recurrent_xla, case, cases.to_jax(x))
    grad = jax.grad(lambda a: jnp.sum(f(a)[0]))
    temp = jax.jit(grad).lower(inputs).compile().memory_analysis().temp_size_in_bytes
    out = 4096 * 2 * 32 * 4
    assert temp <= 2 * out, temp / out
