"""The Pallas path under JAX's transformations and dtypes (bf16/fp16, jit with
traced cu_seqlens and g_gamma, vmap), against the XLA path, under the TPU
memory simulator, and through the Mosaic TPU lowering (jax.export). The one-trace
test of traced cu_seqlens runs the XLA path too."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402

from bridge.contract import check  # noqa: E402
from jax_side.pallas import recurrent_pallas  # noqa: E402
from jax_side.xla import recurrent_xla  # noqa: E402
from parity import cases  # noqa: E402
from parity.compare import TOLERANCE, rel_err  # noqa: E402
from parity.oracle import recurrent, recurrent_grads  # noqa: E402
from jax_cases import errors, outputs  # noqa: E402


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
def test_low_precision_inputs(dtype):
    case = cases.Case(seqlens=(25, 3, 12), H=4, Hk=2, g="key", gv=True, g_gamma="head",
                      initial_state=True)
    errs = errors(case, dtype)
    assert max(errs.values()) <= TOLERANCE[str(jnp.dtype(dtype))], errs


def test_agrees_with_xla_path():
    case, arrays = cases.make(seqlens=(30, 0, 17), g="key", gk=True, gv=True,
                              g_gamma="seq", initial_state=True, reverse=True)
    got = outputs(recurrent_pallas, case, arrays)
    want = outputs(recurrent_xla, case, arrays, chunk_size=16)
    assert rel_err(got[0], want[0]) < 1e-5 and rel_err(got[1], want[1]) < 1e-5
    for n in want[2]:
        assert rel_err(got[2][n], want[2][n]) < 1e-5, n


@pytest.mark.parametrize("fn, tol, kw", [(recurrent_xla, 1e-5, dict(chunk_size=16)),
                                         (recurrent_pallas, 2e-5, {})], ids=["xla", "pallas"])
def test_jit_traced_cu_seqlens_and_gamma_one_trace(fn, tol, kw):
    """cu_seqlens and g_gamma traced: two packings of one total share one trace, and so
    does the gradient of g_gamma through it."""
    _, arrays = cases.make(seqlens=(20, 30, 14), g="key", g_gamma="seq",
                           initial_state=True)
    x = {n: arrays[n] for n in ("q", "k", "v", "g", "g_gamma", "initial_state")}
    traces = []

    def f(q, k, v, g, g_gamma, h0, cu):
        traces.append(1)
        plan = check(q, k, v, g=g, g_gamma=g_gamma, initial_state=h0, cu_seqlens=cu)
        return fn(plan, q, k, v, g=g, g_gamma=g_gamma, initial_state=h0, cu_seqlens=cu, **kw)

    jf = jax.jit(f)
    args = list(x.values())
    for seqlens in ((20, 30, 14), (0, 61, 3)):
        cu = np.concatenate([[0], np.cumsum(seqlens)]).astype(np.int32)
        o, fs = jf(*args, jnp.asarray(cu))
        wo, wfs = recurrent(**x, cu_seqlens=cu)
        assert rel_err(o, wo) < tol and rel_err(fs, wfs) < tol
        dgam = jax.jit(jax.grad(lambda gg, c: jf(*args[:4], gg, args[5], c)[1].sum()))(
            args[4], jnp.asarray(cu))
        want = recurrent_grads(**x, cu_seqlens=cu, do=np.zeros_like(wo),
                               dfinal_state=np.ones_like(wfs))["g_gamma"]
        assert rel_err(dgam, want) < tol
    assert len(traces) == 1  # the jit cache: both packings and the grad reuse one trace
    assert jf._cache_size() == 1


def test_vmap_over_leading_axis():
    xs = [cases.make(seed=s, B=1, T=20, K=8, V=8, g="key", initial_state=True)[1]
          for s in (1, 2)]
    names = ("q", "k", "v", "g", "initial_state")
    stacked = [jnp.stack([x[n] for x in xs]) for n in names]
    plan = check(*[xs[0][n] for n in names[:3]], g=xs[0]["g"],
                 initial_state=xs[0]["initial_state"])
    f = lambda q, k, v, g, h0: recurrent_pallas(plan, q, k, v, g=g, initial_state=h0)
    o, fs = jax.vmap(f)(*stacked)
    dq = jax.vmap(jax.grad(lambda *a: f(*a)[0].sum()))(*stacked)
    for i, x in enumerate(xs):
        x = {n: x[n] for n in names}
        wo, wfs = recurrent(**x)
        assert rel_err(o[i], wo) < 2e-5 and rel_err(fs[i], wfs) < 2e-5
        want = recurrent_grads(**x, do=np.ones_like(wo))["q"]
        assert rel_err(dq[i], want) < 2e-5


@pytest.mark.skipif(not hasattr(pltpu, "InterpretParams"), reason="no TPU interpreter here")
def test_tpu_memory_simulation():
    """The TPU interpreter NaN-fills uninitialised memory: catches reads of unwritten blocks."""
    case = cases.Case(seqlens=(9, 0, 20), H=2, K=4, V=4, g="head", gv=True,
                      initial_state=True)
    errs = errors(case, jit=False, interpret=pltpu.InterpretParams())
    assert max(errs.values()) <= TOLERANCE["float32"], errs


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
