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


def bound(fn, case, x, **kw):
    """(f, inputs): `fn` (recurrent_pallas / recurrent_xla) on the case's jax arrays `x`
    as f(inputs), `inputs` the differentiable ones by name ({q, k, v, gates,
    initial_state}); the plan (reverse, softmax_scale) and cu_seqlens (passed only
    where the case has it) are fixed, `kw` go to `fn`."""
    call = cases.call_kwargs(case, x)
    plan = check(**call)
    kw.update({n: call[n] for n in ("cu_seqlens",) if n in call})

    def f(inputs):
        return fn(plan, **inputs, **kw)

    return f, {n: call[n] for n in NAMES if n in call}


def outputs(fn, case, arrays, dtype=jnp.float32, grads=True, jit=True, **kw):
    """(o, final_state, {input: gradient} or None) of `fn` (recurrent_pallas /
    recurrent_xla) on the case's arrays, q/k/v in `dtype`; the gradients are those of
    sum(o * do) + sum(final_state * dfinal_state), the cotangents as given (float32).
    Under jit unless jit=False; `kw` go to `fn`."""
    f, inputs = bound(fn, case, cases.to_jax(arrays, dtype), **kw)
    if not grads:
        return (*(jax.jit(f) if jit else f)(inputs), None)

    def loss(inputs):
        o, fs = f(inputs)
        return (jnp.sum(o.astype(jnp.float32) * arrays["do"])
                + jnp.sum(fs * arrays["dfinal_state"]), (o, fs))

    vg = jax.value_and_grad(loss, has_aux=True)
    (_, (o, fs)), gr = (jax.jit(vg) if jit else vg)(inputs)
    return o, fs, gr


def errors(case, dtype=jnp.float32, seed=0, fn=recurrent_pallas, jit=True, grads=True,
           arrays=None, **kw):
    """{quantity: relative error} of `fn` (the Pallas path) against the float64 oracle,
    both on the case's inputs rounded to `dtype` (or on `arrays`, e.g. edited ones,
    already in their dtype's values), after checking the SPEC's output dtypes and
    shapes; o and final_state only unless `grads`; `jit` and `kw` as in `outputs`."""
    name = str(jnp.dtype(dtype))
    arrays = backends.prepared(case, name, seed) if arrays is None else arrays
    o, fs, gr = outputs(fn, case, arrays, dtype, grads, jit, **kw)
    got = backends.checked(fn.__name__, o, fs, gr or {}, cases.to_jax(arrays, dtype))
    want = backends.Oracle().run(case, arrays, name)
    if not grads:
        want = {n: want[n] for n in ("o", "final_state")}
    return compare_errors({n: np.asarray(g, np.float32) for n, g in got.items()}, want,
                          case.gate_grad_floor)
