"""The Pallas path (jax_side/pallas.py) in interpret mode against the float64
NumPy oracle (outputs, final states, every gradient, per SPEC feature), against
the XLA path, under jit with traced cu_seqlens / g_gamma and vmap, the TPU
memory simulator, and the Mosaic TPU lowering through jax.export."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402

from bridge.contract import check  # noqa: E402
from jax_side.pallas import recurrent_pallas  # noqa: E402
from jax_side.xla import recurrent_xla  # noqa: E402
from parity.compare import TOLERANCE, rel_err  # noqa: E402
from parity.oracle import recurrent, recurrent_grads  # noqa: E402

NAMES = ("q", "k", "v", "g", "gk", "gv", "g_gamma", "initial_state")


def make(seed=0, B=2, T=40, H=2, Hk=None, K=8, V=8, g=None, gk=False, gv=False, gamma=None,
         h0=False, seqlens=None, strong=False):
    """Random float32 inputs, cu_seqlens and cotangents. Gates are <= 0: moderate,
    or with `strong` uniform in [-10, -5] a step."""
    rng = np.random.default_rng(seed)
    Hk = Hk or H
    if seqlens is not None:
        B, T = 1, sum(seqlens)
    N = B if seqlens is None else len(seqlens)
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)
    if strong:
        gate = lambda *s: rng.uniform(-10.0, -5.0, s).astype(np.float32)
    else:
        gate = lambda *s: (-np.logaddexp(0, -(rng.standard_normal(s) + 1.5))).astype(np.float32)
    x = dict(q=f32(B, T, H, K), k=f32(B, T, Hk, K), v=f32(B, T, Hk, V))
    if g == "head":
        x["g"] = gate(B, T, H)
    elif g == "key":
        x["g"] = gate(B, T, H, K)
    if gk:
        x["gk"] = gate(B, T, H, K)
    if gv:
        x["gv"] = gate(B, T, H, V)
    if gamma == "head":
        x["g_gamma"] = -rng.uniform(0.01, 1.0, H).astype(np.float32)
    elif gamma == "seq":
        x["g_gamma"] = -rng.uniform(0.01, 1.0, (N, H)).astype(np.float32)
    if h0:
        x["initial_state"] = f32(N, H, K, V)
    cu = None if seqlens is None else np.concatenate([[0], np.cumsum(seqlens)]).astype(np.int32)
    cot = dict(do=f32(B, T, H, V), dfinal_state=f32(N, H, K, V))
    return x, cu, cot


def run(fn, x, cu=None, reverse=False, dtype=jnp.float32, cot=None, **kw):
    """(o, final_state, grads or None) of `fn` (recurrent_pallas / recurrent_xla) under jit."""
    names = [n for n in NAMES if n in x]
    arrs = [jnp.asarray(x[n], dtype if n in ("q", "k", "v") else None) for n in names]
    cu_j = None if cu is None else jnp.asarray(cu)
    plan = check(*arrs[:3], **dict(zip(names[3:], arrs[3:])), reverse=reverse, cu_seqlens=cu)

    def f(*a):
        return fn(plan, *a[:3], **dict(zip(names[3:], a[3:])), cu_seqlens=cu_j, **kw)

    if cot is None:
        return (*jax.jit(f)(*arrs), None)

    def loss(*a):
        o, fs = f(*a)
        return jnp.sum(o.astype(jnp.float32) * cot["do"]) + jnp.sum(fs * cot["dfinal_state"]), (o, fs)

    (_, (o, fs)), grads = jax.jit(jax.value_and_grad(loss, range(len(arrs)), has_aux=True))(*arrs)
    return o, fs, dict(zip(names, grads))


def errors(x, cu, reverse, cot, dtype=jnp.float32):
    """Relative errors of the Pallas path against the oracle on the same rounded values."""
    o, fs, grads = run(recurrent_pallas, x, cu, reverse, dtype, cot)
    xr = dict(x)
    for n in ("q", "k", "v"):
        xr[n] = np.asarray(jnp.asarray(x[n], dtype).astype(jnp.float32))
    wo, wfs = recurrent(**xr, reverse=reverse, cu_seqlens=cu)
    want = recurrent_grads(**xr, reverse=reverse, cu_seqlens=cu, **cot)
    assert o.dtype == dtype and fs.dtype == jnp.float32 and o.shape == wo.shape
    errs = {"o": rel_err(o, wo), "final_state": rel_err(fs, wfs)}
    for n, gr in grads.items():
        assert gr.shape == np.shape(x[n]), n
        assert gr.dtype == (dtype if n in "qkv" else jnp.float32), n
        errs["d" + n] = rel_err(gr, want[n])  # inf when not finite
    return errs


FEATURES = {  # name: (make() arguments, reverse)
    "plain": (dict(), False),
    "g-head": (dict(g="head"), False),
    "g-key-gk-gv": (dict(g="key", gk=True, gv=True, T=33), False),
    "reverse-all": (dict(g="key", gk=True, gv=True, gamma="head", h0=True), True),
    "gqa-k-ne-v": (dict(H=4, Hk=2, K=7, V=12, g="head", gv=True, h0=True), False),
    "strong": (dict(g="key", gv=True, gamma="head", h0=True, strong=True), False),
    "strong-head-rev": (dict(g="head", h0=True, strong=True, T=37), True),
}


@pytest.mark.parametrize("name", list(FEATURES))
def test_feature_matches_oracle(name):
    kw, reverse = FEATURES[name]
    x, cu, cot = make(**kw)
    errs = errors(x, cu, reverse, cot)
    assert max(errs.values()) <= TOLERANCE["float32"], errs


VARLEN = (21, 0, 5, 16, 1, 19)  # ends mid-chunk, an empty sequence, exactly one chunk


@pytest.mark.parametrize("kw, reverse", [
    (dict(H=4, Hk=1, g="head", gk=True, gv=True, gamma="seq", h0=True), True),
    (dict(gamma="seq", gv=True, h0=True, strong=True, K=5, V=9), False),
], ids=["everything-rev", "strong-gamma-seq"])
def test_varlen_matches_oracle(kw, reverse):
    x, cu, cot = make(seqlens=VARLEN, **kw)
    errs = errors(x, cu, reverse, cot)
    assert max(errs.values()) <= TOLERANCE["float32"], errs


def test_varlen_trailing_empty_sequences():
    """Empty sequences at the end (unused chunk slots inherit the last real one)."""
    x, cu, cot = make(seqlens=(0, 18, 0, 0), g="key", gv=True, h0=True)
    errs = errors(x, cu, False, cot)
    assert max(errs.values()) <= TOLERANCE["float32"], errs


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
def test_low_precision_inputs(dtype):
    x, cu, cot = make(seqlens=(25, 3, 12), H=4, Hk=2, g="key", gv=True, gamma="head", h0=True)
    errs = errors(x, cu, False, cot, dtype=dtype)
    assert max(errs.values()) <= TOLERANCE[str(jnp.dtype(dtype))], errs
    assert errs["final_state"] < 1e-5  # fp32 accumulation of exactly rounded inputs


def test_agrees_with_xla_path():
    x, cu, cot = make(seqlens=(30, 0, 17), H=2, g="key", gk=True, gv=True, gamma="seq", h0=True)
    got = run(recurrent_pallas, x, cu, True, cot=cot)
    want = run(recurrent_xla, x, cu, True, cot=cot, chunk_size=16)
    assert rel_err(got[0], want[0]) < 1e-5 and rel_err(got[1], want[1]) < 1e-5
    for n in want[2]:
        assert rel_err(got[2][n], want[2][n]) < 1e-5, n


def test_jit_traced_cu_seqlens_and_gamma():
    """cu_seqlens and g_gamma traced: two packings of one total share one trace."""
    x, _, _ = make(seqlens=(20, 30, 14), g="key", gamma="seq", h0=True)
    traces = []

    def f(q, k, v, g, g_gamma, h0, cu):
        traces.append(1)
        plan = check(q, k, v, g=g, g_gamma=g_gamma, initial_state=h0, cu_seqlens=cu)
        return recurrent_pallas(plan, q, k, v, g=g, g_gamma=g_gamma, initial_state=h0,
                                cu_seqlens=cu)

    jf = jax.jit(f)
    args = [x[n] for n in ("q", "k", "v", "g", "g_gamma", "initial_state")]
    for seqlens in ((20, 30, 14), (0, 61, 3)):
        cu = np.concatenate([[0], np.cumsum(seqlens)]).astype(np.int32)
        o, fs = jf(*args, jnp.asarray(cu))
        wo, wfs = recurrent(**x, cu_seqlens=cu)
        assert rel_err(o, wo) < 2e-5 and rel_err(fs, wfs) < 2e-5
        dgam = jax.jit(jax.grad(lambda gg, c: jf(*args[:4], gg, args[5], c)[1].sum()))(
            args[4], jnp.asarray(cu))
        want = recurrent_grads(**x, cu_seqlens=cu, do=np.zeros_like(wo),
                               dfinal_state=np.ones_like(wfs))["g_gamma"]
        assert rel_err(dgam, want) < 2e-5
    assert len(traces) == 1  # the jit cache: both packings and the grad reuse one trace


def test_vmap_over_leading_axis():
    xs = [make(seed=s, B=1, T=20, g="key", h0=True)[0] for s in (1, 2)]
    names = ("q", "k", "v", "g", "initial_state")
    stacked = [jnp.stack([x[n] for x in xs]) for n in names]
    plan = check(*[xs[0][n] for n in names[:3]], g=xs[0]["g"], initial_state=xs[0]["initial_state"])
    f = lambda q, k, v, g, h0: recurrent_pallas(plan, q, k, v, g=g, initial_state=h0)
    o, fs = jax.vmap(f)(*stacked)
    dq = jax.vmap(jax.grad(lambda *a: f(*a)[0].sum()))(*stacked)
    for i, x in enumerate(xs):
        wo, wfs = recurrent(**x)
        assert rel_err(o[i], wo) < 2e-5 and rel_err(fs[i], wfs) < 2e-5
        want = recurrent_grads(**x, do=np.ones_like(wo))["q"]
        assert rel_err(dq[i], want) < 2e-5


@pytest.mark.skipif(not hasattr(pltpu, "InterpretParams"), reason="no TPU interpreter here")
def test_tpu_memory_simulation():
    """The TPU interpreter NaN-fills uninitialised memory: catches reads of unwritten blocks."""
    x, cu, cot = make(seqlens=(9, 0, 20), H=2, K=4, V=4, g="head", gv=True, h0=True)
    names = [n for n in NAMES if n in x]
    plan = check(*[x[n] for n in names[:3]], **{n: x[n] for n in names[3:]}, cu_seqlens=cu)

    def loss(*a):
        o, fs = recurrent_pallas(plan, *a[:3], **dict(zip(names[3:], a[3:])), cu_seqlens=cu,
                                 interpret=pltpu.InterpretParams())
        return jnp.sum(o * cot["do"]) + jnp.sum(fs * cot["dfinal_state"]), (o, fs)

    (_, (o, fs)), grads = jax.value_and_grad(loss, range(len(names)), has_aux=True)(
        *[x[n] for n in names])
    wo, wfs = recurrent(**x, cu_seqlens=cu)
    want = recurrent_grads(**x, cu_seqlens=cu, **cot)
    assert rel_err(o, wo) < 2e-5 and rel_err(fs, wfs) < 2e-5
    for n, gr in zip(names, grads):
        assert rel_err(gr, want[n]) < 2e-5, n


def _export_text(fn, *shapes):
    exp = jax.export.export(jax.jit(fn), platforms=["tpu"])(*shapes)
    return exp.mlir_module()


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("varlen", [False, True], ids=["batched", "varlen"])
def test_tpu_export(D, dtype, varlen):
    """Mosaic lowers forward and backward kernels for a TPU (no TPU needed)."""
    B, T, H, Hk = (1, 80, 4, 2) if varlen else (2, 64, 2, 2)
    sd = lambda *s, dt=dtype: jax.ShapeDtypeStruct(s, dt)
    shapes = [sd(B, T, H, D), sd(B, T, Hk, D), sd(B, T, Hk, D), sd(B, T, H, D, dt=jnp.float32),
              sd(B, T, H, D, dt=jnp.float32)]
    N = 3 if varlen else B
    shapes.append(sd(N, H, D, D, dt=jnp.float32))
    if varlen:
        shapes.append(jax.ShapeDtypeStruct((N + 1,), jnp.int32))
    z = lambda s: np.zeros(s.shape, s.dtype)
    plan = check(*[z(s) for s in shapes[:3]], g=z(shapes[3]), gv=z(shapes[4]),
                 initial_state=z(shapes[5]),
                 cu_seqlens=np.array([0, 30, 30, T], np.int32) if varlen else None)

    def fwd(q, k, v, g, gv, h0, cu=None):
        return recurrent_pallas(plan, q, k, v, g=g, gv=gv, initial_state=h0, cu_seqlens=cu,
                                interpret=False)

    def loss(*a):
        o, fs = fwd(*a)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(fs)

    assert "tpu_custom_call" in _export_text(fwd, *shapes)
    assert "tpu_custom_call" in _export_text(jax.grad(loss, range(6)), *shapes)
