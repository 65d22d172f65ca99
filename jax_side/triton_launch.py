"""The `bridge` Triton kernels launched from JAX, behind a `jax.custom_vjp`.

On CUDA, each launch is a `jax_triton.triton_call` (the 0.3 and 0.4 APIs); on
CPU the same launch list runs in Triton's interpreter through
`jax.pure_callback`, the arrays passed zero-copy into torch CPU tensors by
DLPack (`bridge.torch_runner`).
`jax.lax.platform_dependent` picks, so one jitted function serves both. Under
`jax.vmap` the mapped axis folds into the batch: one launch for all elements.
"""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from bridge import grads
from bridge.contract import INPUTS, PER_SEQUENCE, PER_TOKEN
from bridge.kernels import family
from bridge.launch import resolve_dtype

from .sharding import vary, varying, vary_all

_cache_dir = os.environ.get("TRITON_CACHE_DIR")
try:  # jax-triton imports only with a GPU jaxlib
    import jax_triton as jt
except Exception:  # ImportError, or AttributeError from a mismatched jaxlib
    jt = None
finally:
    # jax-triton 0.3 sets TRITON_CACHE_DIR="" on import: every later compile through
    # Triton's own launcher in this process (the torch ops, fla) would then fail with
    # "Could not create or locate cache dir" (seen on an H100). Its own compiles
    # don't use that cache.
    if _cache_dir is None:
        os.environ.pop("TRITON_CACHE_DIR", None)
    else:
        os.environ["TRITON_CACHE_DIR"] = _cache_dir

def _spec(out, env):
    return jax.ShapeDtypeStruct(out.shape, jnp.dtype(resolve_dtype(out.dtype, env)))


def _jt_api():
    """jax-triton's API generation: (0, 3) or (0, 4)."""
    return tuple(int(x) for x in jt.__version__.split(".")[:2])


def _varying_results(launch_fn):
    """Under shard_map the results vary over the inputs' mesh axes: pure_callback
    (and a kernel call) types them unvaried whatever the result specs say."""

    @functools.wraps(launch_fn)
    def wrapped(launches, env, want):
        axes = varying(*env.values())
        return {n: vary(x, axes) for n, x in launch_fn(launches, env, want).items()}

    return wrapped


@_varying_results
def _run_gpu(launches, env, want):
    env = dict(env)
    dummy = env["q"]
    new_api = _jt_api() >= (0, 4)
    for launch in launches:
        # jax-triton takes the inputs and scalars positionally, in the kernel's order,
        # and the outputs' specs apart (they follow them: Launch checks it)
        args, outputs = [], []
        for _, kind, value in launch.arguments():
            if kind == "out":
                outputs.append(value)
            elif kind == "scalar":
                # Triton's own launcher (the torch side) types a Python float as fp32.
                # jax-triton 0.3 types it as fp64 (so pass np.float32); 0.4 as fp32 and
                # deprecates np.float32. Either way both frameworks run one variant.
                args.append(np.float32(value) if isinstance(value, float) and not new_api
                            else value)
            else:
                args.append(dummy if value is None else env[value])
        shapes = [jax.ShapeDtypeStruct((1,), jnp.float32) if o is None else _spec(o, env)
                  for o in outputs]
        out_kw = {"out_type" if new_api else "out_shape": shapes}
        outs = jt.triton_call(*args, kernel=launch.kernel, grid=launch.grid,
                              num_warps=launch.num_warps, num_stages=launch.num_stages,
                              **out_kw, **launch.constexprs)
        for o, x in zip(outputs, outs):
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


@_varying_results
def _run_cpu(launches, env, want):
    names = [n for n, x in env.items() if x is not None]
    specs = {o.name: _spec(o, env) for launch in launches for o in launch.writes()}

    def callback(*arrays):
        import torch

        from bridge.torch_runner import run

        from bridge import kernels

        tenv = {n: torch.from_dlpack(a) for n, a in zip(names, arrays)}
        if not kernels.INTERPRETED:  # JAX CPU arrays on a GPU machine: compiled kernels need CUDA
            tenv = {n: t.cuda() for n, t in tenv.items()}
        run(launches, tenv)
        return tuple(_to_host(tenv[n].cpu()) for n in want)

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




def _kept(plan, mode) -> tuple:
    """The forward buffers the family's backward reuses (bridge.kernels.chunk.kept)."""
    return family(mode).kept(plan)


def _execute(plan, mode, stage, env):
    """Run one stage ("fwd", "primal" or "bwd") of the kernels on a dict of arrays (absent
    inputs left out). fwd -> {o, final_state, kept buffers}; primal (no backward follows:
    nothing kept) -> {o, final_state}; bwd -> {input name: gradient}."""
    kept = _kept(plan, mode)
    env = {n: env.get(n) for n in (*INPUTS, "cu_seqlens", "final_state", "do",
                                   "dfinal_state", *kept)}
    kernels = family(mode)
    if stage == "fwd":
        return run(kernels.forward_launches(plan), env, ("o", "final_state", *kept))
    if stage == "primal":
        return run(kernels.forward_launches(plan, keep=False), env, ("o", "final_state"))
    launches = kernels.backward_launches(plan, use_dht=True, kept=kept)
    made = {o.name for launch in launches for o in launch.writes()}
    got = grads.assemble(plan, run(launches, env, [n for n in grads.BUFFERS if n in made]))
    return {n: got[n].astype(env[n].dtype) for n in INPUTS if env[n] is not None}


@functools.lru_cache(maxsize=None)
def _batchable(plan, mode, stage):
    """`_execute` with a vmap rule: the mapped axis folds into the batch (or, packed,
    into the token axis with shifted cu_seqlens), so one launch serves every mapped
    element. jax-triton has no batching rule of its own; on CPU it also replaces
    the callback's one-element-at-a-time vmap."""

    @jax.custom_batching.custom_vmap
    def execute(env):
        return _execute(plan, mode, stage, env)

    @execute.def_vmap
    def rule(axis_size, in_batched, env):
        folded_plan, folded = fold(plan, axis_size, in_batched[0], env)
        out = _batchable(folded_plan, mode, stage)(folded)
        return unfold(plan, axis_size, out), {n: True for n in out}

    return execute


def fold(plan, n, batched, env):
    """(plan, env) for the n mapped problems as one (`Plan.folded`): [n, B, ...] ->
    [n*B, ...] (packed: [n, 1, T, ...] -> [1, n*T, ...], cu_seqlens shifted and joined);
    g_gamma always in its per-sequence [N, H] form."""
    def mapped(name):
        x = env[name]
        return x if batched[name] else jnp.broadcast_to(x, (n, *x.shape))

    out = {}
    for name in env:
        if name in PER_TOKEN:
            x = mapped(name)
            out[name] = (x.reshape(1, n * plan.T, *x.shape[3:]) if plan.varlen
                         else x.reshape(n * plan.B, *x.shape[2:]))
        elif name in PER_SEQUENCE:
            x = mapped(name)
            out[name] = x.reshape(n * plan.N, *x.shape[2:])
    if "g_gamma" in env:
        x = mapped("g_gamma")
        if plan.g_gamma == "head":
            x = jnp.broadcast_to(x[:, None], (n, plan.N, plan.H))
        out["g_gamma"] = x.reshape(n * plan.N, plan.H)
    if plan.varlen:
        cu = mapped("cu_seqlens")
        starts = cu[:, :-1] + (jnp.arange(n, dtype=cu.dtype) * plan.T)[:, None]
        out["cu_seqlens"] = jnp.concatenate([starts.reshape(-1),
                                             jnp.full((1,), n * plan.T, cu.dtype)])
    return plan.folded(n), out


def unfold(plan, n, out):
    """Split results of the folded problem back along the mapped axis."""
    res = {}
    for name, x in out.items():
        if name in PER_TOKEN:
            res[name] = (x.reshape(n, 1, plan.T, *x.shape[2:]) if plan.varlen
                         else x.reshape(n, plan.B, *x.shape[1:]))
        elif name == "g_gamma":
            x = x.reshape(n, plan.N, plan.H)
            res[name] = x.sum(1) if plan.g_gamma == "head" else x
        else:
            res[name] = x.reshape(n, plan.N, *x.shape[1:])
    return res


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def triton_kernels(plan, mode, inputs, cu_seqlens):
    """The kernels of `mode` ("chunk" or "fused_recurrent") on `inputs`, the arrays of
    `bridge.contract.INPUTS` by name (batched layout, absent ones None): (o [B,T,H,V] in
    q's dtype, final_state [N,H,K,V] fp32). Differentiable in every floating input.
    Undifferentiated it keeps nothing for a backward (stage "primal")."""
    out = _batchable(plan, mode, "primal")(_present(cu_seqlens=cu_seqlens, **inputs))
    return out["o"], out["final_state"]


def _present(**arrays):
    """The given arrays, typed alike under shard_map (see `run`)."""
    arrays = {n: x for n, x in arrays.items() if x is not None}
    return dict(zip(arrays, vary_all(*arrays.values())))


def _forward(plan, mode, inputs, cu_seqlens):
    out = _batchable(plan, mode, "fwd")(_present(cu_seqlens=cu_seqlens, **inputs))
    kept = {n: out[n] for n in _kept(plan, mode)}
    return (out["o"], out["final_state"]), (inputs, cu_seqlens, out["final_state"], kept)


def _backward(plan, mode, residuals, cotangents):
    inputs, cu_seqlens, final_state, kept = residuals
    do, dfinal_state = cotangents
    env = _present(cu_seqlens=cu_seqlens, final_state=final_state, do=do,
                   dfinal_state=dfinal_state, **inputs, **kept)
    got = _batchable(plan, mode, "bwd")(env)
    return {n: got.get(n) for n in inputs}, None


triton_kernels.defvjp(_forward, _backward)
