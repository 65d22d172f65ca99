"""The public PyTorch ops of SPEC.md, differentiable through every array input.

`platform`: "triton" (the `bridge` kernels: compiled on CUDA, interpreted on
CPU), "torch" (the chunked algorithm in plain torch ops), or "auto" (Triton on
CUDA tensors, torch on CPU tensors, except that mode="fused_recurrent" on CPU
means the interpreted Triton kernel). `mode`: "fused_recurrent", "chunk" or
"auto" (Triton kernels only: the cheaper family by `contract.kernel_costs`, fused
recurrent for short sequences and decoding; the torch platform is chunked).
"""

import torch

from bridge import contract, variants
from . import triton_launch

PLATFORMS = ("auto", "triton", "torch")


def recurrent(q, k, v, g=None, g_gamma=None, gk=None, gv=None, softmax_scale=None,
              initial_state=None, reverse=False, cu_seqlens=None, *, platform="auto",
              mode="auto"):
    plan = contract.check(q, k, v, g, g_gamma, gk, gv, softmax_scale, initial_state, reverse,
                          cu_seqlens)
    platform = contract.route(platform, mode, PLATFORMS, "torch", gpu=q.device.type == "cuda")

    def batched(x):
        if x is None:
            return None
        return (x.unsqueeze(0) if plan.packed else x).contiguous()

    tokens = [batched(x) for x in (q, k, v, g, gk, gv)]
    rest = [None if x is None else x.contiguous() for x in (g_gamma, initial_state)]
    if platform == "torch":
        from .native import recurrent_native

        o, final_state = recurrent_native(plan, *tokens[:3], g=tokens[3], gk=tokens[4],
                                          gv=tokens[5], g_gamma=rest[0], initial_state=rest[1],
                                          cu_seqlens=cu_seqlens)
    else:
        o, final_state = triton_launch.TritonKernels.apply(
            plan, contract.kernel_mode(mode, plan), cu_seqlens, *tokens, *rest)
    return (o[0] if plan.packed else o), final_state


recurrent.__doc__ = variants.RECURRENT_DOC


recurrent_gla, lightning_attn, gla_attention = variants.named_variants(
    recurrent, lambda a, like: torch.from_numpy(a).to(like.device))
