"""The public PyTorch ops of SPEC.md, differentiable through every array input.

`platform`: "triton" (the `bridge` kernels: compiled on CUDA, interpreted on
CPU), "torch" (the chunked algorithm in plain torch ops), or "auto" (Triton on
CUDA tensors, torch on CPU tensors, except that mode="fused_recurrent" on CPU
means the interpreted Triton kernel). `mode`: "fused_recurrent", "chunk" or
"auto" (Triton only; see `_pick_mode`).
"""

import torch

from bridge import contract, variants
from . import triton_launch

PLATFORMS = ("auto", "triton", "torch")
MODES = ("auto", "chunk", "fused_recurrent")


def _pick_platform(platform, mode, q):
    if platform not in PLATFORMS:
        raise ValueError(f"platform: expected one of {PLATFORMS}, got {platform!r}")
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    if platform == "auto":
        platform = "triton" if q.device.type == "cuda" or mode == "fused_recurrent" else "torch"
    if platform == "torch" and mode == "fused_recurrent":
        raise ValueError("mode: 'fused_recurrent' is a Triton kernel; platform='torch' computes "
                         "the chunked form (use mode='auto' or 'chunk')")
    return platform


def _pick_mode(mode, plan):
    if mode == "chunk":
        raise NotImplementedError("mode='chunk' (the chunked Triton kernels) is not available "
                                  "yet; use mode='fused_recurrent' or platform='torch'")
    return "fused_recurrent"


def recurrent(q, k, v, g=None, g_gamma=None, gk=None, gv=None, softmax_scale=None,
              initial_state=None, reverse=False, cu_seqlens=None, *, platform="auto",
              mode="auto"):
    """The general gated recurrence of SPEC.md.

    q [B,T,H,K], k [B,T,Hk,K], v [B,T,Hk,V] (or packed [total,H,*] with
    cu_seqlens); g [B,T,H(,K)], gk [B,T,H,K], gv [B,T,H,V] log decays; g_gamma
    [H] or [N,H]; initial_state [N,H,K,V]. Returns (o [B,T,H,V] in q's dtype,
    final_state [N,H,K,V] float32).
    """
    plan = contract.check(q, k, v, g=g, g_gamma=g_gamma, gk=gk, gv=gv,
                          softmax_scale=softmax_scale, initial_state=initial_state,
                          reverse=reverse, cu_seqlens=cu_seqlens)
    platform = _pick_platform(platform, mode, q)

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
        _pick_mode(mode, plan)
        o, final_state = triton_launch.FusedRecurrent.apply(plan, cu_seqlens, *tokens, *rest)
    return (o[0] if plan.packed else o), final_state


recurrent_gla, lightning_attn, gla_attention = variants.named_variants(
    recurrent, lambda a, like: torch.from_numpy(a).to(like.device))
