"""The public PyTorch ops of SPEC.md, differentiable through every array input.

`platform`: "triton" (the `bridge` kernels: compiled on CUDA, interpreted on
CPU), "torch" (the chunked algorithm in plain torch ops), or "auto" (Triton on
CUDA tensors, torch on CPU tensors, except that mode="fused_recurrent" on CPU
means the interpreted Triton kernel). `mode`: "fused_recurrent", "chunk",
"fused_chunk" or "auto" (Triton kernels only: the device table's ranking where it has
one, else the cheaper family by `dispatch.kernel_costs`, fused recurrent for short
sequences and decoding: `dispatch.kernel_mode`; the torch platform is chunked).
ejkernel's platform names: "cuda" means "triton" on CUDA tensors (a ValueError on
others); "xla", "pallas", "tilelang", "cute" are ValueErrors that say what to use.
`query`, `key`, `value` are accepted for q, k, v (ejkernel's names).

Every call goes prepare -> strategy -> run, as jax_side.ops does:

  prepare   `bridge.dispatch.prepare` checks the arguments once (the contract; the Plan)
            and resolves the platform and kernel, then the inputs take the batched layout
            (`_prepare`);
  strategy  "direct": eager, with nothing for the op to do (no autograd recording, no
            tracing, no autocast, plain tensors: `custom_ops.direct`), the op's body
            itself, skipping the dispatcher, which costs more than a decoding step's
            recurrence; "op": one `gla_bridge::fwd` custom op (torch_side/custom_ops.py),
            which owns autograd, fake tensors, autocast, vmap and batch/head-sharded
            DTensors (torch.compile(fullgraph=True) and torch.export see one node);
            either one runs inside the context-parallel combine with `context_group`; a
            DTensor q sharded on time re-enters `recurrent` on each rank's shards with
            its mesh dimension as the group (torch_side/dtensor.py);
  run       `_run`: o back in the caller's layout.

`context_group` (a torch.distributed ProcessGroup): the inputs are this rank's slice of
the time axis, and the call runs context-parallel over the group (torch_side/context.py;
`cu_seqlens` are then the global packed offsets). DTensor inputs: sharded on the batch or
heads, the op runs on each shard (torch_side/dtensor.py); sharded on time, the
context-parallel path over that mesh dimension.
"""

import torch

from bridge import contract, dispatch, variants
from bridge.kernels import INTERPRETED
from . import context, custom_ops, dtensor, torch_internals

PLATFORMS = ("auto", "triton", "torch")


def recurrent(q=None, k=None, v=None, g=None, g_gamma=None, gk=None, gv=None,
              softmax_scale=None, initial_state=None, reverse=False, cu_seqlens=None,
              block_k=None, block_v=None, num_warps=None, num_stages=None, *,
              platform="auto", mode="auto", context_group=None, query=None, key=None,
              value=None):
    # ejkernel's names, resolved only when one is used or q/k/v is missing: the eager
    # decoding path pays a few comparisons, not a call
    if q is None or k is None or v is None or query is not None or key is not None or \
            value is not None:
        q, k, v = variants.take_aliases(q, k, v, query, key, value)
    inputs = dict(q=q, k=k, v=v, g=g, gk=gk, gv=gv, g_gamma=g_gamma,
                  initial_state=initial_state)
    # the strategy (module doc). Direct inputs are plain tensors that nothing traces: no
    # DTensor or tracing case applies to them
    direct = custom_ops.direct(inputs, cu_seqlens)
    time_sharded = None if direct else dtensor.time_sharded(q)
    if time_sharded is not None:
        if context_group is not None:
            raise ValueError("context_group: a time-sharded DTensor q brings its own "
                             "group (its mesh dimension); give one or the other")
        return dtensor.context_parallel_call(
            recurrent, time_sharded, q, k, v, g=g, g_gamma=g_gamma, gk=gk, gv=gv,
            softmax_scale=softmax_scale, initial_state=initial_state, reverse=reverse,
            cu_seqlens=cu_seqlens, platform=platform, mode=mode)
    call, inputs, cu_seqlens = _prepare(
        inputs, cu_seqlens, direct=direct, context_group=context_group,
        softmax_scale=softmax_scale, reverse=reverse, platform=platform, mode=mode)
    return _run(call, inputs, cu_seqlens, direct=direct, context_group=context_group)


def _prepare(inputs, cu_seqlens, *, direct, context_group, softmax_scale, reverse,
             platform, mode):
    """Check the call once (contract, device) and lay `inputs` out for the op: (the
    dispatch Call, the arrays by name in the batched layout, contiguous, and cu_seqlens;
    DTensors where q is one). cu_seqlens values are read where they are concrete, once:
    by the contract here on the direct path; on the op path by the op where it reads them
    (`custom_ops.checks_offsets`: under torch.compile or torch.func the op is the first
    place they are concrete), else here; with `context_group` they are the global
    offsets, checked here against all slices."""
    if context_group is not None:
        P = context.group_size_rank(context_group)[0]  # a bad group fails first
    compiling = not direct and torch.compiler.is_compiling()
    traced = cu_seqlens is not None and not direct and (
        compiling or torch_internals.transform_active())
    shape_only = cu_seqlens is not None and (not direct or context_group is not None)
    call = dispatch.prepare(
        inputs, softmax_scale=softmax_scale, reverse=reverse,
        cu_seqlens=contract.ShapeOnly(cu_seqlens) if shape_only else cu_seqlens,
        platform=platform, mode=mode, platforms=PLATFORMS, fallback="torch",
        gpu=getattr(inputs["q"], "is_cuda", False), memo=not compiling)
    plan = call.plan
    if shape_only and not traced:
        if context_group is not None:
            contract.check_offsets(cu_seqlens, P * plan.T)
        elif not custom_ops.checks_offsets(call.kernel, cu_seqlens):
            contract.check_offsets(cu_seqlens, plan.T)
    if call.platform == "triton":
        _check_device(inputs["q"])
    if not direct and dtensor.is_dtensor(inputs["q"]):
        # plain tensors beside DTensors: the whole value
        inputs = dtensor.promote(inputs["q"], dict(inputs, cu_seqlens=cu_seqlens))
        cu_seqlens = inputs.pop("cu_seqlens")
    if plan.packed:  # (else `inputs` is already in the batched layout)
        inputs = dispatch.batched(plan, inputs, lambda x: x.unsqueeze(0))
    return call, {n: None if x is None else x.contiguous() for n, x in inputs.items()}, \
        cu_seqlens


def _check_device(q):
    """ValueError unless the Triton kernels can run on q's device (before any launch)."""
    if q.device.type == "cpu" and not INTERPRETED:
        raise ValueError("q: platform='triton' on CPU tensors needs the Triton interpreter; "
                         "set TRITON_INTERPRET=1 before anything imports triton, or use "
                         "platform='torch'")
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"q: platform='triton' runs on CUDA (or CPU, interpreted) tensors, "
                         f"got device {q.device}")


def _run(call, inputs, cu_seqlens, *, direct, context_group):
    """The strategy's forward on the prepared inputs: (o in the caller's layout,
    final_state). The op's third output, the buffer its backward reuses, stays with
    autograd."""
    plan, kernel = call.plan, call.kernel
    if direct and context_group is None:  # a decoding step's path: nothing around it
        o, final_state, _ = custom_ops.forward(plan, kernel, inputs, cu_seqlens, keep=False)
        return dispatch.unbatched(plan, o), final_state

    def local(inputs, cu_seqlens):  # (o, final_state) of this rank's pass
        if direct:  # on the Plan checked above (a context slice has the same shapes)
            return custom_ops.forward(plan, kernel, inputs, cu_seqlens, keep=False)[:2]
        return custom_ops.fwd(**inputs, cu_seqlens=cu_seqlens, scale=plan.scale,
                              reverse=plan.reverse, mode=kernel)[:2]

    if context_group is None:
        o, final_state = local(inputs, cu_seqlens)
    else:
        o, final_state = context.context_parallel(local, context_group, inputs, cu_seqlens,
                                                  plan.scale, plan.reverse)
    return dispatch.unbatched(plan, o), final_state


recurrent.__doc__ = variants.RECURRENT_DOC
