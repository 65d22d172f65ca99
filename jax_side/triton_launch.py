"""The `bridge` Triton kernels launched from JAX, behind a `jax.custom_vjp`.

On CUDA, each launch is a `jax_triton.triton_call`; on CPU the same launch list
runs in Triton's interpreter through `jax.pure_callback`, the arrays passed
zero-copy into torch CPU tensors by DLPack (`bridge.torch_runner`).
`jax.lax.platform_dependent` picks, so one jitted function serves both.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from bridge import grads
from bridge.kernels import fused_recurrent
from bridge.launch import resolve_dtype

try:  # jax-triton imports only with a GPU jaxlib
    import jax_triton as jt
except Exception:  # ImportError, or AttributeError from a mismatched jaxlib
    jt = None

ARGS = grads.INPUTS


def _spec(out, env):
    return jax.ShapeDtypeStruct(out.shape, jnp.dtype(resolve_dtype(out.dtype, env)))


def _run_gpu(launches, env, want):
    env = dict(env)
    dummy = env["q"]
    for launch in launches:
        args = [dummy if n is None else env[n] for n in launch.inputs]
        # jax-triton types a Python float as fp64; Triton's own launcher (the
        # torch side) as fp32. Match it, so both frameworks run one variant.
        scalars = [np.float32(s) if isinstance(s, float) else s for s in launch.scalars]
        shapes = [jax.ShapeDtypeStruct((1,), jnp.float32) if o is None else _spec(o, env)
                  for o in launch.outputs]
        outs = jt.triton_call(*args, *scalars, kernel=launch.kernel, out_shape=shapes,
                              grid=launch.grid, num_warps=launch.num_warps,
                              num_stages=launch.num_stages, **launch.constexprs)
        for o, x in zip(launch.outputs, outs):
            if o is not None:
                env[o.name] = x
    return {n: env[n] for n in want}


def _to_host(t):
    """A torch CPU tensor as a NumPy array JAX accepts (bf16 via ml_dtypes)."""
    import torch

    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _run_cpu(launches, env, want):
    names = [n for n, x in env.items() if x is not None]
    specs = {o.name: _spec(o, env) for launch in launches for o in launch.outputs if o}

    def callback(*arrays):
        import torch

        from bridge.torch_runner import run

        tenv = {n: torch.from_dlpack(a) for n, a in zip(names, arrays)}
        run(launches, tenv)
        return tuple(_to_host(tenv[n]) for n in want)

    outs = jax.pure_callback(callback, tuple(specs[n] for n in want),
                             *[env[n] for n in names], vmap_method="sequential")
    return dict(zip(want, outs))


def run(launches, env, want):
    """Execute the launch list on jax arrays; returns {name: array} for `want`."""
    cpu = functools.partial(_run_cpu, launches, want=want)
    if jt is None:
        return cpu(env)
    gpu = functools.partial(_run_gpu, launches, want=want)
    return jax.lax.platform_dependent(env, cpu=cpu, cuda=gpu)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def fused_recurrent_call(plan, cu_seqlens, q, k, v, g, gk, gv, g_gamma, initial_state):
    """(o [B,T,H,V] in q's dtype, final_state [N,H,K,V] fp32); batched layout,
    absent inputs None. Differentiable in every floating input."""
    return _forward(plan, cu_seqlens, q, k, v, g, gk, gv, g_gamma, initial_state)[0]


def _forward(plan, cu_seqlens, *inputs):
    env = dict(zip(ARGS, inputs), cu_seqlens=cu_seqlens)
    out = run(fused_recurrent.forward_launches(plan), env, ("o", "final_state"))
    return (out["o"], out["final_state"]), (cu_seqlens, inputs, out["final_state"])


def _backward(plan, residuals, cotangents):
    cu_seqlens, inputs, final_state = residuals
    do, dfinal_state = cotangents
    env = dict(zip(ARGS, inputs), cu_seqlens=cu_seqlens, final_state=final_state,
               do=do, dfinal_state=dfinal_state)
    launches = fused_recurrent.backward_launches(plan, use_dht=True)
    made = {o.name for launch in launches for o in launch.outputs if o}
    want = [n for n in grads.BUFFERS if n in made]
    got = grads.assemble(plan, run(launches, env, want))
    return (None, *(None if x is None else got[n].astype(x.dtype)
                    for n, x in zip(ARGS, inputs)))


fused_recurrent_call.defvjp(_forward, _backward)
