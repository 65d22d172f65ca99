"""Inputs, runs and oracle errors shared by the JAX chunked-path tests (test_jax_xla.py,
test_pallas*.py)."""

import jax
import jax.numpy as jnp
import numpy as np

from bridge.contract import check
from jax_side.pallas import recurrent_pallas
from parity.compare import rel_err
from parity.oracle import recurrent, recurrent_grads

NAMES = ("q", "k", "v", "g", "gk", "gv", "g_gamma", "initial_state")


def make(seed=0, B=2, T=40, H=2, Hk=None, K=8, V=8, g=None, gk=False, gv=False, gamma=None,
         h0=False, seqlens=None, strong=False, strength=1.0):
    """Random float32 inputs, cu_seqlens and cotangents. Gates are <= 0: log-sigmoids
    times `strength`, or with `strong` uniform in [-10, -5] a step."""
    rng = np.random.default_rng(seed)
    Hk = Hk or H
    if seqlens is not None:
        B, T = 1, sum(seqlens)
    N = B if seqlens is None else len(seqlens)
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)
    if strong:
        gate = lambda *s: rng.uniform(-10.0, -5.0, s).astype(np.float32)
    else:
        gate = lambda *s: (strength * -np.logaddexp(0, -(rng.standard_normal(s) + 1.5))
                           ).astype(np.float32)
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
        x["g_gamma"] = (-strength * rng.uniform(0.01, 1.0, H)).astype(np.float32)
    elif gamma == "seq":
        x["g_gamma"] = (-strength * rng.uniform(0.01, 1.0, (N, H))).astype(np.float32)
    if h0:
        x["initial_state"] = f32(N, H, K, V)
    cu = None if seqlens is None else np.concatenate([[0], np.cumsum(seqlens)]).astype(np.int32)
    cot = dict(do=f32(B, T, H, V), dfinal_state=f32(N, H, K, V))
    return x, cu, cot


def run(fn, x, cu=None, reverse=False, dtype=jnp.float32, cot=None, jit=True, **kw):
    """(o, final_state, grads or None) of `fn` (recurrent_pallas / recurrent_xla), under
    jit unless jit=False; `kw` go to `fn`."""
    names = [n for n in NAMES if n in x]
    arrs = [jnp.asarray(x[n], dtype if n in ("q", "k", "v") else None) for n in names]
    cu_j = None if cu is None else jnp.asarray(cu)
    plan = check(*arrs[:3], **dict(zip(names[3:], arrs[3:])), reverse=reverse, cu_seqlens=cu)

    def f(*a):
        return fn(plan, *a[:3], **dict(zip(names[3:], a[3:])), cu_seqlens=cu_j, **kw)

    if cot is None:
        return (*(jax.jit(f) if jit else f)(*arrs), None)

    def loss(*a):
        o, fs = f(*a)
        return jnp.sum(o.astype(jnp.float32) * cot["do"]) + jnp.sum(fs * cot["dfinal_state"]), (o, fs)

    vg = jax.value_and_grad(loss, range(len(arrs)), has_aux=True)
    (_, (o, fs)), grads = (jax.jit(vg) if jit else vg)(*arrs)
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
