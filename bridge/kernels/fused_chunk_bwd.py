"""The on-chip backward of mode="fused_chunk": two walks with the state or its gradient in
registers, then fused_recurrent's combine pass.

Notation of fused_recurrent.py's module docstring (S~_t: the state before step t adds its
own token; the primed gradients leave out the step's own q.k term), at chunk granularity:
one program per (sequence x head, V block) walks 32-token chunks, all of K in one block.

  fused_chunk_bwd_dq_kernel   the forward walk again, S [K, BV] fp32 in registers:
      dq'_t = scale (e^(A_t) S_start) do_t + scale sum_{s<t} (do_t.v_s) e^(a_s+1..a_t) k_s,
      a partial per V block [B,T,H,NV,K] fp32; with dht and a key gate also the final-state
      term sum_V dht S~_T [N,H,NV,K] (the last token's k v left out of the last update).
  fused_chunk_bwd_dkv_kernel  the reverse walk, dS [K, BV] fp32 in registers from dht:
      dk'_s = (dS_end v_s) e^(a_s+1..a_end) + scale sum_{t>s} (do_t.v_s) (decay) q_t
      (partial per V block), dv'_s = (k_s gated to the end) dS_end + sum_{t>s} A_ts do_t
      (per query head), then dS_start = e^(A_c) dS_end + scale (q gated from the start)^T do;
      d(initial_state) is dS after the first chunk.
  fused_recurrent_bwd_combine_kernel (fused_recurrent.py, reused): dq, dk, dv with the
      step's own terms, and the key-gate gradients as reverse cumulative sums of
      q dq' - k dk' from the final-state term.

Decays inside a chunk are common.seg_sums of the log decays (sums of consecutive decays,
exact fp32 sums of the decays' own values); the pairs s < t by levels of their highest
differing position bit (chunk_fwd.py), each level's decay F(t) F(s), both factors <= 0 in
the exponent, the F-scaled operand in two pieces of its 16-bit dtype (chunk_bwd.py: the
dq and dk sides of a pair must round alike for the gate gradient).
"""

import os

import triton
import triton.language as tl

from ..contract import ITEMSIZE
from ..launch import Launch, Out
from . import chunk
from .common import (block_pos, decay_k_in, exact_dtype, exp_, flags, head_gamma, level_mask,
                     load_tile, next_pow2, op_dtype, present, seg_matrix, seg_sums, seq_bounds,
                     tile_ptrs, varlen_input)
from .fused_recurrent import fused_recurrent_bwd_combine_kernel


@triton.jit
def _factor(a, o_t, h, DT: tl.constexpr):
    """exp of the segmented sums of level h (common.seg_matrix) of the log decays a
    [BT, BK]: h = 2 BT from the chunk start to t, BT from t + 1 to the chunk end."""
    return exp_(seg_sums(seg_matrix(o_t, h, DT), a, DT))


@triton.jit
def _dot2(w, y, op: tl.constexpr, DOT_PREC: tl.constexpr):
    """w @ y for fp32 y [BT, D] in two pieces of the 16-bit dtype op (one for fp32)."""
    y0 = y.to(op)
    if op == tl.float32:
        return tl.dot(w, y0, input_precision=DOT_PREC)
    p = tl.dot(w, (y - y0.to(tl.float32)).to(op), input_precision=DOT_PREC)
    return tl.dot(w, y0, p, input_precision=DOT_PREC)


@triton.jit
def _key_decays(g, gk, gamma, row0, pos, mask_t, i_h, o_k, mask_k, H: tl.constexpr,
                K: tl.constexpr, G_MODE: tl.constexpr, USE_GK: tl.constexpr,
                GAMMA_MODE: tl.constexpr):
    """The key-side log decays of a chunk [BT, BK] in their exact dtype (common.decay_k_in)."""
    DT: tl.constexpr = exact_dtype(g.dtype.element_ty, gk.dtype.element_ty, G_MODE, USE_GK,
                                   GAMMA_MODE)
    return decay_k_in(DT, g, gk, gamma, row0, pos, mask_t, i_h, o_k, mask_k, H, K, G_MODE,
                      USE_GK, GAMMA_MODE)


@triton.jit
def fused_chunk_bwd_dq_kernel(
    q, k, v, g, gk, g_gamma, h0, cu_seqlens, do, dht,
    scale, T,
    dq_part, dfa,
    H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr,
    G_MODE: tl.constexpr, USE_GK: tl.constexpr, GAMMA_MODE: tl.constexpr,
    USE_H0: tl.constexpr, USE_DHT: tl.constexpr, IS_VARLEN: tl.constexpr,
    REVERSE: tl.constexpr, LEVELS: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """One (sequence x head, V block): dq' partials [B,T,H,NV,K] fp32 and, with USE_DHT and
    g or gk, dfa [N,H,NV,K] = sum over the block's V of dht S~_T (0 for an empty sequence)."""
    scale = tl.cast(scale, tl.float32)  # a float scalar may come as fp64 (common.py)
    pid = tl.program_id(0)
    i_nh, i_v = pid // NV, pid % NV
    i_n, i_h = i_nh // H, i_nh % H
    i_hk = i_h // (H // HK)
    KGATE: tl.constexpr = (G_MODE > 0) or USE_GK or (GAMMA_MODE > 0)
    FINAL_A: tl.constexpr = USE_DHT and ((G_MODE > 0) or USE_GK)
    DT: tl.constexpr = exact_dtype(g.dtype.element_ty, gk.dtype.element_ty, G_MODE, USE_GK,
                                   GAMMA_MODE)
    op: tl.constexpr = op_dtype(q.dtype.element_ty)
    bos, eos = seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)
    gamma = head_gamma(g_gamma, i_n, i_h, H, GAMMA_MODE)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k, mask_v = o_k < K, o_v < V
    base = i_nh.to(tl.int64) * K * V
    p_kv = o_k[:, None] * V + o_v[None, :]
    b_s = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        b_s += tl.load(h0 + base + p_kv, mask=mask_k[:, None] & mask_v[None, :],
                       other=0.).to(tl.float32)
    n = eos - bos
    nc = tl.cdiv(n, BT)
    for c in range(0, nc):
        row0, pos, mask_t = block_pos(bos, eos, c * BT, BT, REVERSE)
        a = _key_decays(g, gk, gamma, row0, pos, mask_t, i_h, o_k, mask_k, H, K, G_MODE,
                        USE_GK, GAMMA_MODE)
        b_do = load_tile(do, row0, pos, i_h, o_v, mask_t, mask_v, H, V).to(op)
        b_v = load_tile(v, row0, pos, i_hk, o_v, mask_t, mask_v, HK, V).to(op)
        b_k = load_tile(k, row0, pos, i_hk, o_k, mask_t, mask_k, HK, K)
        acc = tl.dot(b_do, tl.trans(b_s.to(op)), input_precision=DOT_PREC)
        if KGATE:
            acc *= _factor(a, o_t, 2 * BT, DT)
        d_a = tl.dot(b_do, tl.trans(b_v), input_precision=DOT_PREC)
        if KGATE:
            for lvl in range(0, LEVELS):  # one level's tiles live at a time
                hl = (BT // 2) >> lvl
                f = _factor(a, o_t, hl, DT)
                w = tl.where(level_mask(o_t, hl), d_a, 0.).to(op)
                acc += f * _dot2(w, b_k.to(tl.float32) * f, op, DOT_PREC)
        else:
            acc += _dot2(tl.where(o_t[:, None] > o_t[None, :], d_a, 0.).to(op),
                         b_k.to(tl.float32), op, DOT_PREC)
        p_dq = tile_ptrs(dq_part, row0, pos, i_h * NV + i_v, o_k, H * NV, K)
        tl.store(p_dq, acc * scale, mask=mask_t[:, None] & mask_k[None, :])
        if FINAL_A:  # S~_T: the last token's k v stays out of the last update
            b_k = tl.where((c * BT + o_t == n - 1)[:, None], 0., b_k)
        if KGATE:  # gated to the chunk's end
            b_k = (b_k.to(tl.float32) * _factor(a, o_t, BT, DT)).to(op)
            b_s *= exp_(tl.sum(a.to(tl.float32), 0))[:, None]
        b_s = tl.dot(tl.trans(b_k.to(op)), b_v, b_s, input_precision=DOT_PREC)
    if FINAL_A:
        b_dht = tl.load(dht + base + p_kv, mask=mask_k[:, None] & mask_v[None, :], other=0.)
        last = tl.sum(b_dht * b_s, 1)
        tl.store(dfa + (i_nh * NV + i_v) * K + o_k, tl.where(n > 0, last, 0.), mask=mask_k)


@triton.jit
def _level_mask_t(o_t, h):
    """level_mask transposed: [s, t] for the pairs t > s of level h."""
    x = o_t[:, None] ^ o_t[None, :]
    return (x >= h) & (x < 2 * h) & ((o_t & h) != 0)[None, :]


@triton.jit
def fused_chunk_bwd_dkv_kernel(
    q, k, v, g, gk, g_gamma, cu_seqlens, do, dht,
    scale, T,
    dk_part, dv_part, dh0,
    H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr,
    G_MODE: tl.constexpr, USE_GK: tl.constexpr, GAMMA_MODE: tl.constexpr,
    USE_H0: tl.constexpr, USE_DHT: tl.constexpr, IS_VARLEN: tl.constexpr,
    REVERSE: tl.constexpr, LEVELS: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """One (sequence x head, V block), chunks last to first: dk' partials [B,T,H,NV,K] fp32,
    dv' per query head [B,T,H,V] fp32 and (USE_H0) dh0 [N,H,K,V] fp32."""
    scale = tl.cast(scale, tl.float32)  # a float scalar may come as fp64 (common.py)
    pid = tl.program_id(0)
    i_nh, i_v = pid // NV, pid % NV
    i_n, i_h = i_nh // H, i_nh % H
    i_hk = i_h // (H // HK)
    KGATE: tl.constexpr = (G_MODE > 0) or USE_GK or (GAMMA_MODE > 0)
    DT: tl.constexpr = exact_dtype(g.dtype.element_ty, gk.dtype.element_ty, G_MODE, USE_GK,
                                   GAMMA_MODE)
    op: tl.constexpr = op_dtype(q.dtype.element_ty)
    bos, eos = seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)
    gamma = head_gamma(g_gamma, i_n, i_h, H, GAMMA_MODE)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k, mask_v = o_k < K, o_v < V
    base = i_nh.to(tl.int64) * K * V
    p_kv = o_k[:, None] * V + o_v[None, :]
    b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_DHT:
        b_dh += tl.load(dht + base + p_kv, mask=mask_k[:, None] & mask_v[None, :], other=0.)
    nc = tl.cdiv(eos - bos, BT)
    for i in range(0, nc):
        row0, pos, mask_t = block_pos(bos, eos, (nc - 1 - i) * BT, BT, REVERSE)
        a = _key_decays(g, gk, gamma, row0, pos, mask_t, i_h, o_k, mask_k, H, K, G_MODE,
                        USE_GK, GAMMA_MODE)
        b_q = load_tile(q, row0, pos, i_h, o_k, mask_t, mask_k, H, K)
        b_k = load_tile(k, row0, pos, i_hk, o_k, mask_t, mask_k, HK, K)
        b_do = load_tile(do, row0, pos, i_h, o_v, mask_t, mask_v, H, V).to(op)
        b_v = load_tile(v, row0, pos, i_hk, o_v, mask_t, mask_v, HK, V).to(op)
        # through the chunk end's state gradient (one 16-bit copy of it for both)
        dh_op = b_dh.to(op)
        acc_k = tl.dot(b_v, tl.trans(dh_op), input_precision=DOT_PREC)
        if KGATE:
            f = _factor(a, o_t, BT, DT)
            acc_k *= f
            acc_v = tl.dot((b_k.to(tl.float32) * f).to(op), dh_op, input_precision=DOT_PREC)
        else:
            acc_v = tl.dot(b_k.to(op), dh_op, input_precision=DOT_PREC)
        d_at = tl.dot(b_v, tl.trans(b_do), input_precision=DOT_PREC)  # dA^T [s, t]
        if KGATE:
            for lvl in range(0, LEVELS):  # one level's tiles live at a time
                hl = (BT // 2) >> lvl
                f = _factor(a, o_t, hl, DT)
                m_t = _level_mask_t(o_t, hl)
                w = tl.where(m_t, d_at, 0.).to(op)
                acc_k += f * _dot2(w, b_q.to(tl.float32) * f, op, DOT_PREC) * scale
                # A^T [s, t] of the level: (x F)(x F)^T is symmetric, x = q on the rows
                # of t's segments, k on s's
                p = (tl.where(((o_t & hl) != 0)[:, None], b_q, b_k).to(tl.float32) * f).to(op)
                a_t = tl.dot(p, tl.trans(p), input_precision=DOT_PREC)
                acc_v += tl.dot(tl.where(m_t, a_t * scale, 0.).to(op), b_do,
                                input_precision=DOT_PREC)
        else:
            later = o_t[:, None] < o_t[None, :]
            acc_k += _dot2(tl.where(later, d_at, 0.).to(op), b_q.to(tl.float32), op,
                           DOT_PREC) * scale
            a_t = tl.dot(b_k.to(op), tl.trans(b_q.to(op)), input_precision=DOT_PREC)
            acc_v += tl.dot(tl.where(later, a_t * scale, 0.).to(op), b_do,
                            input_precision=DOT_PREC)
        m_tk = mask_t[:, None] & mask_k[None, :]
        tl.store(tile_ptrs(dk_part, row0, pos, i_h * NV + i_v, o_k, H * NV, K),
                 acc_k, mask=m_tk)
        tl.store(tile_ptrs(dv_part, row0, pos, i_h, o_v, H, V), acc_v,
                 mask=mask_t[:, None] & mask_v[None, :])
        b_qs = b_q.to(tl.float32) * scale
        if KGATE:  # gated from the chunk's start
            b_qs *= _factor(a, o_t, 2 * BT, DT)
            b_dh *= exp_(tl.sum(a.to(tl.float32), 0))[:, None]
        b_dh = tl.dot(tl.trans(b_qs.to(op)), b_do, b_dh, input_precision=DOT_PREC)
    if USE_H0:
        tl.store(dh0 + base + p_kv, b_dh, mask=mask_k[:, None] & mask_v[None, :])


# ---------------------------------------------------------------- launch plan

BT = 16  # chunk length (the forward takes 32)
LEVELS = BT.bit_length() - 1


def supported(plan) -> bool:
    """Whether these kernels take the plan: chosen (GLA_BRIDGE_FUSED_CHUNK_BWD=onchip; the
    default "chunk" keeps the chunk family's list, see fused_chunk.py), no value gate gv
    and no constant decay g_gamma (their gradients are not written here), K <= 128."""
    chosen = os.environ.get("GLA_BRIDGE_FUSED_CHUNK_BWD", "chunk") == "onchip"
    return chosen and not plan.gv and plan.g_gamma == "none" and plan.K <= 128


def config(plan) -> dict:
    """All of K in one block; V blocks of 64 for 16-bit inputs, 16 for fp32 (FMA
    products); 8 warps: at K = V = 128 without spills on sm_90 (`python -m bridge.aot`
    builds; sm_80 spills 56-472 bytes in fused_chunk_bwd_dkv_kernel, 16-bit)."""
    BK = max(16, next_pow2(plan.K))
    BV = min(64 if plan.dtype in ("bfloat16", "float16") else 16, max(16, next_pow2(plan.V)))
    return dict(BK=BK, BV=BV, NV=-(-plan.V // BV), num_warps=8)


def launches(plan, use_dht: bool) -> list:
    """Reads the forward inputs, do [B,T,H,V] and (use_dht) dfinal_state [N,H,K,V]; writes
    dq_part, dk_part [B,T,H,NV,K], dv_part [B,T,H,V], dfa [N,H,NV,K] (fp32) on the way and
    the buffers bridge.grads reads (module docstring). `supported(plan)` must hold."""
    c = config(plan)
    B, T, H, K, V, N, NV = plan.B, plan.T, plan.H, plan.K, plan.V, plan.N, c["NV"]
    fl = flags(plan)
    consts = dict(H=fl["H"], HK=fl["HK"], K=K, V=V, BT=BT, BK=c["BK"], BV=c["BV"], NV=NV,
                  G_MODE=fl["G_MODE"], USE_GK=fl["USE_GK"], GAMMA_MODE=fl["GAMMA_MODE"],
                  USE_H0=plan.initial_state, USE_DHT=use_dht, IS_VARLEN=plan.varlen,
                  REVERSE=plan.reverse, LEVELS=LEVELS, DOT_PREC=chunk.dot_precision())
    gates = present(plan, "g", "gk", "g_gamma")
    cu = varlen_input(plan)
    dht = "dfinal_state" if use_dht else None
    final_a = use_dht and (plan.g != "none" or plan.gk)
    own = plan.group == 1
    isz = ITEMSIZE[plan.dtype]
    tokens = B * T
    chunks = T // BT + N if plan.varlen else B * -(-T // BT)
    key_gated = plan.g != "none" or plan.gk
    # per chunk and V block: dq: do S^T, do v^T, the levels' [BT,BT]x[BT,K] in 2 pieces
    intra = 2 * LEVELS if key_gated else 2
    fl_dq = 2 * BT * chunks * H * NV * (2 * K * c["BV"] + BT * c["BV"] + BT * K * intra)
    # dkv: v dh^T, k dh, dA^T, 2-piece dk levels, A^T per level, A^T do, the dh update
    fl_dkv = 2 * BT * chunks * H * NV * (3 * K * c["BV"] + BT * c["BV"] + BT * K * intra
                                         + (LEVELS if key_gated else 1) * BT * (K + c["BV"]))
    part = tokens * H * NV * K * 4
    in_bytes = tokens * (2 * H * K + plan.Hk * (K + V) + H * V) * isz
    return [
        Launch(fused_chunk_bwd_dq_kernel, grid=(NV * N * H,),
               inputs=dict(q="q", k="k", v="v", **gates,
                           h0="initial_state" if plan.initial_state else None, **cu, do="do",
                           dht=dht),
               scalars=dict(scale=plan.scale, T=T),
               outputs=dict(dq_part=Out("dq_part", (B, T, H, NV, K)),
                            dfa=Out("dfa", (N, H, NV, K)) if final_a else None),
               constexprs=consts, num_warps=c["num_warps"], dot_flops=int(fl_dq),
               bytes=int(in_bytes + part)),
        Launch(fused_chunk_bwd_dkv_kernel, grid=(NV * N * H,),
               inputs=dict(q="q", k="k", v="v", **gates, **cu, do="do", dht=dht),
               scalars=dict(scale=plan.scale, T=T),
               outputs=dict(dk_part=Out("dk_part", (B, T, H, NV, K)),
                            dv_part=Out("dv_part", (B, T, H, V)),
                            dh0=Out("d_initial_state", (N, H, K, V))
                            if plan.initial_state else None),
               constexprs=consts,
               num_warps=c["num_warps"], dot_flops=int(fl_dkv),
               bytes=int(in_bytes + part + tokens * H * V * 4)),
        Launch(fused_recurrent_bwd_combine_kernel, grid=(N * H,),
               inputs=dict(q="q", k="k", v="v", do="do", **cu, dq_part="dq_part",
                           dk_part="dk_part", dv_part="dv_part", odo=None,
                           dfa="dfa" if final_a else None, dfb=None, dgamma_part=None),
               scalars=dict(scale=plan.scale, T=T),
               outputs=dict(dq=Out("dq", (B, T, H, K), "like:q"),
                            dk_h=Out("dk_h", (B, T, H, K), "like:k" if own else "float32"),
                            dv_h=Out("dv_h", (B, T, H, V), "like:v" if own else "float32"),
                            da=Out("da", (B, T, H, K), "like:g" if plan.g == "key" else "like:gk")
                            if plan.g == "key" or plan.gk else None,
                            dg_head=Out("dg_head", (B, T, H)) if plan.g == "head" else None,
                            dgamma=None, db=None),
               constexprs=dict(fl, BK=c["BK"], BVF=next_pow2(V), NV=NV,
                               USE_H0=plan.initial_state, USE_DHT=use_dht),
               num_warps=1,
               bytes=int(in_bytes + 2 * part + tokens * H * V * 4)),
    ]
