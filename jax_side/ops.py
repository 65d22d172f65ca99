"""The public JAX ops of SPEC.md: jittable, differentiable in every floating input.

`platform`: "triton" (the `bridge` kernels: jax-triton on CUDA, Triton's
interpreter through a host callback on CPU), "xla" (the chunked algorithm in
jax.numpy / lax), "pallas" (chunked Pallas kernels for TPU; interpret mode on any
other machine) or "auto" (Triton on GPU, Pallas on TPU, XLA elsewhere); ejkernel's
"cuda" means "triton" on a GPU backend (a ValueError elsewhere), its "tilelang" and
"cute" are ValueErrors. `mode` picks the Triton kernel family, as on the PyTorch side.
`query`, `key`, `value` are accepted for q, k, v (ejkernel's names).
`context_axis`: a mesh axis name; inside jax.shard_map with the time axis split
over it, the call runs context-parallel (jax_side.context). With more than one
device, a call outside shard_map goes through jax_side.sharding's batch/head
partitioning rule. Only Python values (scale, reverse, platform, mode, context_axis)
are static: `cu_seqlens` and `g_gamma` may be traced. Reverse mode everywhere;
forward mode (jax.jvp) only
where the derivative is JAX autodiff (`forward_mode_ok`), elsewhere a TypeError
that says why (SPEC.md, "Gradients").
"""

import dataclasses
import functools

import jax
import jax.interpreters.ad  # noqa: F401  (JVPTracer)
import jax.numpy as jnp

from bridge import dispatch, variants
from . import sharding

PLATFORMS = ("auto", "triton", "xla", "pallas")


def recurrent(q=None, k=None, v=None, g=None, g_gamma=None, gk=None, gv=None,
              softmax_scale=None, initial_state=None, reverse=False, cu_seqlens=None,
              block_k=None, block_v=None, num_warps=None, num_stages=None, *,
              platform="auto", mode="auto", context_axis=None, query=None, key=None,
              value=None):
    q, k, v = variants.take_aliases(q, k, v, query, key, value)
    cu_global = cu_seqlens
    if context_axis is not None:  # the time axis is split over a mesh axis
        from . import context

        context.axis_position(context_axis)  # a clear error first, outside shard_map
        if cu_seqlens is not None and hasattr(q, "shape") and len(q.shape) in (3, 4):
            cu_seqlens = context.local_offsets(cu_seqlens, q.shape[-3], context_axis)
    inputs = dict(q=q, k=k, v=v, g=g, gk=gk, gv=gv, g_gamma=g_gamma,
                  initial_state=initial_state)
    backend = jax.default_backend()
    call = dispatch.prepare(inputs, softmax_scale=softmax_scale, reverse=reverse,
                            cu_seqlens=cu_seqlens, platform=platform, mode=mode,
                            platforms=PLATFORMS, fallback="xla", gpu=backend == "gpu",
                            tpu=backend == "tpu")
    plan = call.plan
    inputs = dispatch.batched(plan, {n: None if x is None else jnp.asarray(x)
                                     for n, x in inputs.items()}, lambda x: x[None])
    cu_seqlens = None if cu_seqlens is None else jnp.asarray(cu_seqlens)
    forward_mode = _in_forward_mode(*inputs.values())
    if forward_mode and not forward_mode_ok(plan, call.platform):
        raise TypeError(forward_mode_message(plan, call.platform))
    local = functools.partial(_local_pass, platform=call.platform, kernel=call.kernel)
    if context_axis is None and sharding.partitions(call.platform, backend) and \
            not sharding.varying(*inputs.values(), cu_seqlens) and not forward_mode:
        # many devices, outside shard_map: batch/head-sharded inputs stay local (its
        # custom_vjp has no forward mode: jax.jvp takes the plain call)
        o, final_state = sharding.batch_head_sharded(local, plan, inputs, cu_seqlens)
    elif context_axis is None:
        o, final_state = local(plan, inputs, cu_seqlens)
    else:
        o, final_state = context.context_parallel(plan, local, context_axis, inputs,
                                                  cu_seqlens, cu_global)
    return dispatch.unbatched(plan, o), final_state


def _local_pass(plan, inputs, cu_seqlens, *, platform, kernel):
    """One platform's call on `inputs` (the arrays of `bridge.contract.INPUTS` by name,
    batched layout, absent ones None): (o, final_state). Inside shard_map every input
    is first typed with the union of their varying mesh axes (check_vma), and the XLA
    path gets its zero initial state that way too."""
    inputs = dict(zip(inputs, sharding.vary_all(*inputs.values())))
    axes = sharding.varying(inputs["q"], inputs["k"], inputs["v"])
    if axes and inputs["initial_state"] is None and platform == "xla":
        # the XLA path's scan carry starts from the initial state: an unvaried zero
        # state would not match the varying carry it produces
        inputs["initial_state"] = sharding.vary(jnp.zeros(
            (plan.N, plan.H, plan.K, plan.V),
            jnp.float32 if plan.dtype != "float64" else jnp.float64), axes)
        plan = dataclasses.replace(plan, initial_state=True)
    try:
        if platform == "xla":
            from .xla import recurrent_xla

            return recurrent_xla(plan, **inputs, cu_seqlens=cu_seqlens)
        if platform == "pallas":
            from .pallas import recurrent_pallas

            return recurrent_pallas(plan, **inputs, cu_seqlens=cu_seqlens)
        from .triton_launch import triton_kernels

        return triton_kernels(plan, kernel, inputs, cu_seqlens)
    except TypeError as e:
        # jax.jvp / jacfwd traced through one of our custom_vjp rules: JAX's own
        # message does not say which path has one, nor what works instead
        if "forward-mode" not in str(e):
            raise
        raise TypeError(forward_mode_message(plan, platform)) from e


def forward_mode_ok(plan, platform) -> bool:
    """Whether this call's derivative is plain JAX autodiff (so jax.jvp works)."""
    if platform != "xla":
        return False  # Triton and Pallas: custom_vjp over their backward kernels
    from .xla import has_custom_vjp

    return not has_custom_vjp(plan)


def _in_forward_mode(*xs) -> bool:
    """Whether any input is traced by jax.jvp / jax.jacfwd (also inside jax.jit), so
    the error comes before anything runs and names its cause; JAX's own TypeError
    (caught below) covers what this cannot see."""
    tracer = getattr(jax.interpreters.ad, "JVPTracer", None)
    return tracer is not None and any(isinstance(x, tracer) for x in xs)


def forward_mode_message(plan, platform) -> str:
    """Why this call has no forward-mode derivative (SPEC.md, "Gradients")."""
    if platform == "xla":
        why = ("platform='xla' defines the in-chunk part of key-dim gates (g [B,T,H,K] or gk, "
               "without gv) in float32/16 with a custom VJP")
    else:
        why = (f"platform={platform!r} defines its derivative with a custom VJP (its backward "
               "kernels)")
    return (f"forward-mode differentiation (jax.jvp, jax.jacfwd, jax.linearize) is not supported "
            f"here: {why}. Use reverse mode (jax.grad, jax.vjp, jax.jacrev), or platform='xla' "
            f"with float64 inputs (or without key-dim gates), where forward mode works.")


recurrent.__doc__ = variants.RECURRENT_DOC
