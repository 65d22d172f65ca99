"""The public PyTorch ops of SPEC.md, differentiable through every array input.

`platform`: "triton" (the `bridge` kernels: compiled on CUDA, interpreted on
CPU), "torch" (the chunked algorithm in plain torch ops), or "auto" (Triton on
CUDA tensors, torch on CPU tensors, except that mode="fused_recurrent" on CPU
means the interpreted Triton kernel). `mode`: "fused_recurrent", "chunk" or
"auto" (Triton kernels only: the cheaper family by `dispatch.kernel_costs`, fused
recurrent for short sequences and decoding; the torch platform is chunked).
ejkernel's platform names: "cuda" means "triton" on CUDA tensors (a ValueError on
others); "xla", "pallas", "tilelang", "cute" are ValueErrors that say what to use.
`query`, `key`, `value` are accepted for q, k, v (ejkernel's names).

Every call takes `bridge.dispatch`'s steps (check, route, batched layout), then runs one
`gla_bridge::fwd` custom op (torch_side/custom_ops.py), which owns autograd, fake
tensors, autocast and vmap: torch.compile(fullgraph=True) and torch.export see one node.
An eager call with nothing for the op to do (no autograd recording, no tracing, no
autocast, plain tensors: `custom_ops.direct`) runs the op's body itself, skipping the
dispatcher, which costs more than a decoding step's recurrence.

`context_group` (a torch.distributed ProcessGroup): the inputs are this rank's slice of
the time axis, and the call runs context-parallel over the group (torch_side/context.py;
`cu_seqlens` are then the global packed offsets). DTensor inputs: sharded on the batch or
heads, the op runs on each shard (torch_side/dtensor.py); sharded on time, the
context-parallel path over that mesh dimension.
"""

import torch

from bridge import contract, dispatch, variants
from . import context, custom_ops, dtensor, triton_launch

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
    # eager, nothing to record: the op's body itself on the Plan checked below (the
    # dispatcher costs more than a decoding step's recurrence). Such inputs are plain
    # tensors that nothing traces: no DTensor or tracing case below applies to them
    direct = custom_ops.direct(inputs, cu_seqlens)
    if not direct:
        time_sharded = dtensor.time_sharded(q)
        if time_sharded is not None:
            if context_group is not None:
                raise ValueError("context_group: a time-sharded DTensor q brings its own "
                                 "group (its mesh dimension); give one or the other")
            return dtensor.context_parallel_call(
                recurrent, time_sharded, q, k, v, g=g, g_gamma=g_gamma, gk=gk, gv=gv,
                softmax_scale=softmax_scale, initial_state=initial_state, reverse=reverse,
                cu_seqlens=cu_seqlens, platform=platform, mode=mode)
    if context_group is not None:
        P = context.group_size_rank(context_group)[0]  # a bad group fails first
    compiling = not direct and torch.compiler.is_compiling()
    # with context_group, cu_seqlens are the global offsets: checked against all slices.
    # Values traced (torch.compile, torch.func transforms): the contract checks only
    # their shape (SPEC: cu_seqlens values checked when known)
    global_cu = context_group is not None and cu_seqlens is not None
    traced = cu_seqlens is not None and not direct and (
        compiling or torch._C._functorch.peek_interpreter_stack() is not None)
    call = dispatch.prepare(
        inputs, softmax_scale=softmax_scale, reverse=reverse,
        cu_seqlens=contract.ShapeOnly(cu_seqlens) if global_cu or traced else cu_seqlens,
        platform=platform, mode=mode, platforms=PLATFORMS, fallback="torch",
        gpu=getattr(q, "is_cuda", False), memo=not compiling)
    plan = call.plan
    if global_cu and not traced:
        contract.check_offsets(cu_seqlens, P * plan.T)
    if call.platform == "triton":
        triton_launch.check_device(q)
    if not direct and dtensor.is_dtensor(q):  # plain tensors beside DTensors: the whole value
        inputs = dtensor.promote(q, dict(inputs, cu_seqlens=cu_seqlens))
        cu_seqlens = inputs.pop("cu_seqlens")
    if plan.packed:  # (else `inputs` is already in the batched layout)
        inputs = dispatch.batched(plan, inputs, lambda x: x.unsqueeze(0))
    inputs = {n: None if x is None else x.contiguous() for n, x in inputs.items()}
    if direct and context_group is None:  # on the Plan checked above
        o, final_state = custom_ops.run(plan, call.kernel, inputs, cu_seqlens)
        return dispatch.unbatched(plan, o), final_state
    options = dict(scale=plan.scale, reverse=plan.reverse, mode=call.kernel)
    if context_group is not None:
        op = custom_ops.forward if direct else custom_ops.fwd
        o, final_state = context.context_parallel(
            lambda inputs, cu_seqlens: op(**inputs, cu_seqlens=cu_seqlens, **options),
            context_group, inputs, cu_seqlens, plan.scale, plan.reverse)
    else:
        o, final_state = custom_ops.fwd(**inputs, cu_seqlens=cu_seqlens, **options)
    return dispatch.unbatched(plan, o), final_state


recurrent.__doc__ = variants.RECURRENT_DOC
