"""`@triton.jit` helpers and launch-plan pieces shared by both kernel families
(fused_recurrent.py and chunk.py): sequence bounds, the constant decay, the
flags and gate inputs of a Plan. Nothing here is private to one family."""

import triton
import triton.language as tl

MAX_K = 256  # both families hold all of K (or its blocks) of a row on chip


@triton.jit
def seq_bounds(cu_seqlens, i_n, T, IS_VARLEN: tl.constexpr):
    """First and one-past-last token row of sequence i_n (int64)."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
    return bos, eos


@triton.jit
def head_gamma(g_gamma, i_n, i_h, H: tl.constexpr, GAMMA_MODE: tl.constexpr):
    """The constant log decay of this (sequence, head): [H] or [N, H] form, 0 if absent."""
    gamma = 0.0
    if GAMMA_MODE == 1:
        gamma = tl.load(g_gamma + i_h).to(tl.float32)
    if GAMMA_MODE == 2:
        gamma = tl.load(g_gamma + i_n * H + i_h).to(tl.float32)
    return gamma


def next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def check_k(plan, mode: str) -> None:
    if plan.K > MAX_K:
        raise ValueError(f"q: mode='{mode}' supports K <= {MAX_K}, got K={plan.K}")


def flags(plan) -> dict:
    """The constexpr switches of a Plan that every kernel of both families takes."""
    return dict(H=plan.H, HK=plan.Hk, K=plan.K, V=plan.V,
                G_MODE={"none": 0, "head": 1, "key": 2}[plan.g], USE_GK=plan.gk,
                USE_GV=plan.gv, GAMMA_MODE={"none": 0, "head": 1, "seq": 2}[plan.g_gamma],
                IS_VARLEN=plan.varlen, REVERSE=plan.reverse)


def gate_inputs(plan) -> tuple:
    """Input names of the gates, in kernel order (g, gk, gv, g_gamma); None where absent."""
    return ("g" if plan.g != "none" else None, "gk" if plan.gk else None,
            "gv" if plan.gv else None, "g_gamma" if plan.g_gamma != "none" else None)


def key_gated(plan) -> bool:
    """Whether any decay acts along K (g, gk or g_gamma)."""
    return plan.g != "none" or plan.gk or plan.g_gamma != "none"
