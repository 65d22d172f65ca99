"""Runs and oracle errors shared by the JAX chunked-path tests (test_jax_xla.py,
test_pallas*.py); their inputs come from `parity.cases` (batched layout: the chunked
paths take [1, total, H, *] for packed sequences)."""

import jax
import jax.numpy as jnp
import numpy as np

from bridge.contract import check
from jax_side.pallas import recurrent_pallas
from parity import backends, cases
from parity.compare import errors as compare_errors

NAMES = cases.INPUTS


def outputs(fn, case, arrays, dtype=jnp.float32, grads=True, jit=True, **kw):
    """(o, final_state, {input: gradient} or None) of `fn` (recurrent_pallas /
    recurrent_xla) on the case's arrays, q/k/v in `dtype`; the gradients are those of
    sum(o * do) + sum(final_state * dfinal_state), the cotangents as given (float32).
    Under jit unless jit=False; `kw` go to `fn`."""
    x = cases.to_jax(arrays, dtype)
    call = cases.call_kwargs(case, x)
    names = [n for n in NAMES if n in call]
    plan = check(**call)  # reverse and softmax_scale travel in the plan

    def f(*a):
        return fn(plan, **dict(zip(names, a)), cu_seqlens=call.get("cu_seqlens"), **kw)

    args = [call[n] for n in names]
    if not grads:
        return (*(jax.jit(f) if jit else f)(*args), None)

    def loss(*a):
        o, fs = f(*a)
        return (jnp.sum(o.astype(jnp.float32) * arrays["do"])
                + jnp.sum(fs * arrays["dfinal_state"]), (o, fs))

    vg = jax.value_and_grad(loss, range(len(args)), has_aux=True)
    (_, (o, fs)), gr = (jax.jit(vg) if jit else vg)(*args)
    return o, fs, dict(zip(names, gr))


def errors(case, dtype=jnp.float32, seed=0, fn=recurrent_pallas, jit=True, **kw):
    """{quantity: relative error} of `fn` (the Pallas path) against the float64 oracle,
    both on the case's inputs rounded to `dtype`, after checking the SPEC's output dtypes
    and shapes; `jit` and `kw` as in `outputs`."""
    name = str(jnp.dtype(dtype))
    arrays = backends.prepared(case, name, seed)
    o, fs, grads = outputs(fn, case, arrays, dtype, jit=jit, **kw)
    got = backends.checked(fn.__name__, o, fs, grads, cases.to_jax(arrays, dtype))
    want = backends.Oracle().run(case, arrays, name)
    return compare_errors({n: np.asarray(g, np.float32) for n, g in got.items()}, want,
                          case.gate_grad_floor)


# test_jax_xla.py's older vocabulary (gamma, h0, strong, strength; inputs, cu_seqlens and
# cotangents apart), kept until that file builds its cases with parity.cases: delete then.
def make(seed=0, B=2, T=40, H=2, Hk=None, K=8, V=8, g=None, gk=False, gv=False, gamma=None,
         h0=False, seqlens=None, strong=False, strength=1.0):
    """(inputs, cu_seqlens or None, cotangents) of the matching `parity.cases.Case`."""
    case, arrays = cases.make(
        seed, B=1 if seqlens else B, T=T, H=H, Hk=Hk or H, K=K, V=V, g=g or "none", gk=gk,
        gv=gv, g_gamma=gamma or "none", initial_state=h0, seqlens=seqlens,
        gate_scale=strength, gate_range=(5.0, 10.0) if strong else (0.02, 1.0))
    x, cot = cases.split(arrays)
    return x, x.pop("cu_seqlens", None), cot


def run(fn, x, cu=None, reverse=False, dtype=jnp.float32, cot=None, jit=True, **kw):
    """`outputs` with the older vocabulary's arguments."""
    arrays = dict(x, **(cot or {}))
    if cu is not None:
        arrays["cu_seqlens"] = cu
    return outputs(fn, cases.Case(reverse=reverse), arrays, dtype, cot is not None, jit, **kw)
