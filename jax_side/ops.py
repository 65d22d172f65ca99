"""The public JAX ops of SPEC.md: jittable, differentiable in every floating input.

`platform`: "triton" (the `bridge` kernels: jax-triton on CUDA, Triton's
interpreter through a host callback on CPU), "xla" (the chunked algorithm in
jax.numpy / lax), "pallas" (chunked Pallas kernels for TPU; interpret mode on any
other machine) or "auto" (Triton on GPU, Pallas on TPU, XLA elsewhere). `mode` picks the Triton kernel family, as on the PyTorch side.
Only Python values (scale, reverse, platform, mode) are static: `cu_seqlens`
and `g_gamma` may be traced.
"""

import jax
import jax.numpy as jnp

from bridge import contract, variants

PLATFORMS = ("auto", "triton", "xla", "pallas")


def recurrent(q, k, v, g=None, g_gamma=None, gk=None, gv=None, softmax_scale=None,
              initial_state=None, reverse=False, cu_seqlens=None, *, platform="auto",
              mode="auto"):
    plan = contract.check(q, k, v, g, g_gamma, gk, gv, softmax_scale, initial_state, reverse,
                          cu_seqlens)
    backend = jax.default_backend()
    platform = contract.route(platform, mode, PLATFORMS, "xla", gpu=backend == "gpu",
                              tpu=backend == "tpu")

    def batched(x):
        if x is None:
            return None
        x = jnp.asarray(x)
        return x[None] if plan.packed else x

    q, k, v, g, gk, gv = (batched(x) for x in (q, k, v, g, gk, gv))
    g_gamma, initial_state, cu_seqlens = (None if x is None else jnp.asarray(x)
                                          for x in (g_gamma, initial_state, cu_seqlens))
    if platform in ("xla", "pallas"):
        if platform == "xla":
            from .xla import recurrent_xla as chunked
        else:
            from .pallas import recurrent_pallas as chunked
        o, final_state = chunked(plan, q, k, v, g=g, gk=gk, gv=gv, g_gamma=g_gamma,
                                 initial_state=initial_state, cu_seqlens=cu_seqlens)
    else:
        from .triton_launch import triton_kernels

        o, final_state = triton_kernels(plan, contract.kernel_mode(mode, plan), cu_seqlens,
                                        q, k, v, g, gk, gv, g_gamma, initial_state)
    return (o[0] if plan.packed else o), final_state


recurrent.__doc__ = variants.RECURRENT_DOC


recurrent_gla, lightning_attn, gla_attention = variants.named_variants(
    recurrent, lambda a, like: jnp.asarray(a))
