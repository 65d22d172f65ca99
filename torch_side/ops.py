"""The public PyTorch ops of SPEC.md, differentiable through every array input.

`platform`: "triton" (the `bridge` kernels: compiled on CUDA, interpreted on
CPU), "torch" (the chunked algorithm in plain torch ops), or "auto" (Triton on
CUDA tensors, torch on CPU tensors, except that mode="fused_recurrent" on CPU
means the interpreted Triton kernel). `mode`: "fused_recurrent", "chunk" or
"auto" (Triton kernels only: the cheaper family by `dispatch.kernel_costs`, fused
recurrent for short sequences and decoding; the torch platform is chunked).

Every call validates its arguments (`bridge.contract.check`), then runs one
`gla_bridge::fwd` custom op (torch_side/custom_ops.py), which owns autograd, fake
tensors, autocast and vmap: torch.compile(fullgraph=True) and torch.export see one node.

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


class _TracedValues:
    """cu_seqlens as `contract.check` sees it while its values are traced (torch.compile,
    torch.func transforms): a torch tensor's shape, dtype and device, and no values
    (`contract.known_values` gives None, as for a JAX tracer; SPEC: checked when known)."""

    def __init__(self, x):
        self.shape, self.dtype, self.device = tuple(x.shape), x.dtype, x.device

    def detach(self):
        return self

    def cpu(self):
        return self

    def numpy(self):
        return None


def _values_traced(x) -> bool:
    return x is not None and (torch.compiler.is_compiling()
                              or torch._C._functorch.peek_interpreter_stack() is not None)


def recurrent(q, k, v, g=None, g_gamma=None, gk=None, gv=None, softmax_scale=None,
              initial_state=None, reverse=False, cu_seqlens=None, *, platform="auto",
              mode="auto", context_group=None):
    time_sharded = dtensor.time_sharded(q)
    if time_sharded is not None:
        if context_group is not None:
            raise ValueError("context_group: a time-sharded DTensor q brings its own group "
                             "(its mesh dimension); give one or the other")
        return dtensor.context_parallel_call(
            recurrent, time_sharded, q, k, v, g=g, g_gamma=g_gamma, gk=gk, gv=gv,
            softmax_scale=softmax_scale, initial_state=initial_state, reverse=reverse,
            cu_seqlens=cu_seqlens, platform=platform, mode=mode)
    if context_group is not None:
        P = context.group_size_rank(context_group)[0]
    traced = _values_traced(cu_seqlens)
    global_cu = context_group is not None and cu_seqlens is not None and not traced
    cu = _TracedValues(cu_seqlens) if traced or global_cu else cu_seqlens
    plan = contract.check(q, k, v, g=g, g_gamma=g_gamma, gk=gk, gv=gv,
                          softmax_scale=softmax_scale, initial_state=initial_state,
                          reverse=reverse, cu_seqlens=cu)
    if global_cu:
        # the global offsets end at the token count of all P slices (each plan.T tokens)
        every = q.new_empty(()).expand(P * plan.T, 1, 1)
        contract.check(every, every, every, cu_seqlens=cu_seqlens)
    platform = dispatch.route(platform, mode, PLATFORMS, "torch", gpu=q.device.type == "cuda")
    if dtensor.is_dtensor(q):  # plain tensors beside DTensors: the whole value
        k, v, g, g_gamma, gk, gv, initial_state, cu_seqlens = dtensor.promote(q, dict(
            k=k, v=v, g=g, g_gamma=g_gamma, gk=gk, gv=gv, initial_state=initial_state,
            cu_seqlens=cu_seqlens)).values()

    def batched(x):
        if x is None:
            return None
        return (x.unsqueeze(0) if plan.packed else x).contiguous()

    if platform == "torch":
        mode = "torch"
    else:
        triton_launch.check_device(q)
        mode = dispatch.kernel_mode(mode, plan)
    tokens = [batched(x) for x in (q, k, v, g, gk, gv)]
    rest = [None if x is None else x.contiguous() for x in (g_gamma, initial_state)]
    if context_group is not None:
        o, final_state = context.context_parallel(
            lambda *a: custom_ops.fwd(*a, plan.scale, plan.reverse, mode), context_group,
            *tokens, *rest, cu_seqlens, plan.scale, plan.reverse)
    else:
        o, final_state = custom_ops.fwd(*tokens, *rest, cu_seqlens, plan.scale, plan.reverse,
                                        mode)
    return (o[0] if plan.packed else o), final_state


recurrent.__doc__ = variants.RECURRENT_DOC


# torch.tensor of Python floats (exact for float32 values), not from_numpy: traceable
recurrent_gla, lightning_attn, gla_attention = variants.named_variants(
    recurrent, lambda a, like: torch.tensor(a.tolist(), dtype=torch.float32, device=like.device))
