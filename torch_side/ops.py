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
"""

import torch

from bridge import contract, dispatch, variants
from . import custom_ops, triton_launch

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
              mode="auto"):
    cu = _TracedValues(cu_seqlens) if _values_traced(cu_seqlens) else cu_seqlens
    plan = contract.check(q, k, v, g, g_gamma, gk, gv, softmax_scale, initial_state, reverse, cu)
    platform = dispatch.route(platform, mode, PLATFORMS, "torch", gpu=q.device.type == "cuda")

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
    o, final_state = custom_ops.fwd(*tokens, *rest, cu_seqlens, plan.scale, plan.reverse, mode)
    return (o[0] if plan.packed else o), final_state


recurrent.__doc__ = variants.RECURRENT_DOC


# torch.tensor of Python floats (exact for float32 values), not from_numpy: traceable
recurrent_gla, lightning_attn, gla_attention = variants.named_variants(
    recurrent, lambda a, like: torch.tensor(a.tolist(), dtype=torch.float32, device=like.device))
