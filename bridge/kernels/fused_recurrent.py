"""Fused recurrent kernels: one program per (value block, sequence x head), the
fp32 state [K, BV] in registers, a loop over time. The decoding and
short-sequence path.

Layout: every tensor is [B, T, H, *] contiguous (packed input is [1, total, H, *]);
`row` below is the flat token index b*T + t, or the packed index with cu_seqlens.

Backward (three launches, no stored per-step states). With S~_t = S_t - k_t^T v_t
(the state before step t adds its own token) and dS~_t = dS_t - scale q_t^T do_t
(the state gradient before step t adds its own output):
  1. the forward walk again, emitting dq'_t = scale S~_t do_t (partial per value
     block) and, with gv, o'_t * do_t where o'_t = scale q_t S~_t;
  2. a reverse walk of dS, emitting dk'_t = dS~_t v_t (partial per value block),
     dv'_t = k_t dS~_t per query head, and d(initial_state);
  3. a combine pass per (sequence, head): dq = dq' + scale k (v.do),
     dk = dk' + scale q (v.do), dv = dv' + scale (q.k) do, and the gate
     gradients from  dL/da_r = <dS_r, S~_r> summed over V, computed as
        dL/da_r = dL/da_{r+1} + q_r dq'_r - k_r dk'_r   (+ sum_j dS_T S_T at the last step)
     and dL/db_r likewise with o'_r do_r - v_r dv'_r. The primed terms leave out
     the step's own q.k contribution, which would appear in both halves and
     cancel: with strong decays the gate gradient is tiny while that term is
     O(1), and fp32 would lose the result to the cancellation.
"""

import triton
import triton.language as tl

from ..launch import Launch, Out
from .common import check_k, flags, gate_inputs, head_gamma, key_gated, next_pow2, seq_bounds


@triton.jit
def _log_decay_k(g, gk, gamma, row, i_h, o_k, mask_k, H: tl.constexpr, K: tl.constexpr,
                 BK: tl.constexpr, G_MODE: tl.constexpr, USE_GK: tl.constexpr):
    """a_t = g_t + gk_t + gamma over K, fp32 [BK]."""
    a = tl.zeros([BK], dtype=tl.float32) + gamma
    if G_MODE == 1:
        a += tl.load(g + row * H + i_h).to(tl.float32)
    if G_MODE == 2:
        a += tl.load(g + (row * H + i_h) * K + o_k, mask=mask_k, other=0.).to(tl.float32)
    if USE_GK:
        a += tl.load(gk + (row * H + i_h) * K + o_k, mask=mask_k, other=0.).to(tl.float32)
    return a


@triton.jit
def fused_recurrent_fwd_kernel(
    q, k, v, g, gk, gv, g_gamma, h0, cu_seqlens, do,
    scale, T,
    o, ht, dq, odo,
    H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr,
    G_MODE: tl.constexpr, USE_GK: tl.constexpr, USE_GV: tl.constexpr, GAMMA_MODE: tl.constexpr,
    USE_H0: tl.constexpr, IS_VARLEN: tl.constexpr, REVERSE: tl.constexpr, DQ: tl.constexpr,
):
    """Forward walk. DQ=False: o [B,T,H,V], ht [N,H,K,V]. DQ=True (backward
    pass 1): dq' partials [B,T,H,NV,K] and, with gv, o'*do [B,T,H,V] in fp32."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    i_hk = i_h // (H // HK)
    bos, eos = seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k, mask_v = o_k < K, o_v < V
    mask_h = mask_k[:, None] & mask_v[None, :]
    gamma = head_gamma(g_gamma, i_n, i_h, H, GAMMA_MODE)

    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        b_h += tl.load(h0 + (i_nh * K + o_k[:, None]).to(tl.int64) * V + o_v[None, :],
                       mask=mask_h, other=0.).to(tl.float32)
    for i in range(0, eos - bos):
        if REVERSE:
            row = eos - 1 - i
        else:
            row = bos + i
        b_q = tl.load(q + (row * H + i_h) * K + o_k, mask=mask_k, other=0.).to(tl.float32)
        b_k = tl.load(k + (row * HK + i_hk) * K + o_k, mask=mask_k, other=0.).to(tl.float32)
        b_v = tl.load(v + (row * HK + i_hk) * V + o_v, mask=mask_v, other=0.).to(tl.float32)
        if (G_MODE > 0) or USE_GK or (GAMMA_MODE > 0):
            b_a = _log_decay_k(g, gk, gamma, row, i_h, o_k, mask_k, H, K, BK, G_MODE, USE_GK)
            b_h = b_h * tl.exp(b_a)[:, None]
        if USE_GV:
            b_b = tl.load(gv + (row * H + i_h) * V + o_v, mask=mask_v, other=0.).to(tl.float32)
            b_h = b_h * tl.exp(b_b)[None, :]
        if DQ:  # b_h is S~_t here: the step's own token is not in yet
            b_do = tl.load(do + (row * H + i_h) * V + o_v, mask=mask_v, other=0.).to(tl.float32)
            b_dq = tl.sum(b_h * b_do[None, :], axis=1) * scale
            tl.store(dq + ((row * H + i_h) * NV + i_v) * K + o_k, b_dq, mask=mask_k)
            if USE_GV:
                b_o = tl.sum(b_h * b_q[:, None], axis=0) * scale
                tl.store(odo + (row * H + i_h) * V + o_v, b_o * b_do, mask=mask_v)
        b_h += b_k[:, None] * b_v[None, :]
        if not DQ:
            b_o = tl.sum(b_h * b_q[:, None], axis=0) * scale
            tl.store(o + (row * H + i_h) * V + o_v, b_o.to(o.dtype.element_ty), mask=mask_v)
    if not DQ:
        tl.store(ht + (i_nh * K + o_k[:, None]).to(tl.int64) * V + o_v[None, :], b_h, mask=mask_h)


@triton.jit
def fused_recurrent_bwd_dkv_kernel(
    q, k, v, g, gk, gv, g_gamma, ht, cu_seqlens, do, dht,
    scale, T,
    dk, dv, dh0, dfa, dfb,
    H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr,
    G_MODE: tl.constexpr, USE_GK: tl.constexpr, USE_GV: tl.constexpr, GAMMA_MODE: tl.constexpr,
    USE_H0: tl.constexpr, USE_DHT: tl.constexpr, IS_VARLEN: tl.constexpr, REVERSE: tl.constexpr,
    FINAL_TERMS: tl.constexpr,
):
    """Backward pass 2: walk dS from the last step taken to the first.
    dk' partials [B,T,H,NV,K], dv' per query head [B,T,H,V], dh0 [N,H,K,V];
    with FINAL_TERMS the final-state gate terms sum_j dS_T*S_T [N,H,NV,K]
    and sum_i dS_T*S_T [N,H,V]."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    i_hk = i_h // (H // HK)
    bos, eos = seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k, mask_v = o_k < K, o_v < V
    mask_h = mask_k[:, None] & mask_v[None, :]
    p_state = (i_nh * K + o_k[:, None]).to(tl.int64) * V + o_v[None, :]
    gamma = head_gamma(g_gamma, i_n, i_h, H, GAMMA_MODE)

    b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_DHT:
        b_dh += tl.load(dht + p_state, mask=mask_h, other=0.).to(tl.float32)
        if FINAL_TERMS:
            b_last = b_dh * tl.load(ht + p_state, mask=mask_h, other=0.)
            if (G_MODE > 0) or USE_GK or (GAMMA_MODE > 0):
                tl.store(dfa + (i_nh * NV + i_v) * K + o_k, tl.sum(b_last, axis=1), mask=mask_k)
            if USE_GV:
                tl.store(dfb + i_nh * V + o_v, tl.sum(b_last, axis=0), mask=mask_v)
    for i in range(0, eos - bos):
        if REVERSE:
            row = bos + i
        else:
            row = eos - 1 - i
        b_q = tl.load(q + (row * H + i_h) * K + o_k, mask=mask_k, other=0.).to(tl.float32)
        b_k = tl.load(k + (row * HK + i_hk) * K + o_k, mask=mask_k, other=0.).to(tl.float32)
        b_v = tl.load(v + (row * HK + i_hk) * V + o_v, mask=mask_v, other=0.).to(tl.float32)
        b_do = tl.load(do + (row * H + i_h) * V + o_v, mask=mask_v, other=0.).to(tl.float32)
        # b_dh is dS~_t here: the step's own output is not in yet
        tl.store(dk + ((row * H + i_h) * NV + i_v) * K + o_k,
                 tl.sum(b_dh * b_v[None, :], axis=1), mask=mask_k)
        tl.store(dv + (row * H + i_h) * V + o_v, tl.sum(b_dh * b_k[:, None], axis=0), mask=mask_v)
        b_dh += (b_q * scale)[:, None] * b_do[None, :]
        if (G_MODE > 0) or USE_GK or (GAMMA_MODE > 0):
            b_a = _log_decay_k(g, gk, gamma, row, i_h, o_k, mask_k, H, K, BK, G_MODE, USE_GK)
            b_dh = b_dh * tl.exp(b_a)[:, None]
        if USE_GV:
            b_b = tl.load(gv + (row * H + i_h) * V + o_v, mask=mask_v, other=0.).to(tl.float32)
            b_dh = b_dh * tl.exp(b_b)[None, :]
    if USE_H0:
        tl.store(dh0 + p_state, b_dh, mask=mask_h)


@triton.jit
def fused_recurrent_bwd_combine_kernel(
    q, k, v, do, cu_seqlens, dq_part, dk_part, dv_part, odo, dfa, dfb,
    scale, T,
    dq, dk_h, dv_h, da, dg_head, dgamma, db,
    H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BVF: tl.constexpr, NV: tl.constexpr,
    G_MODE: tl.constexpr, USE_GK: tl.constexpr, USE_GV: tl.constexpr, GAMMA_MODE: tl.constexpr,
    USE_DHT: tl.constexpr, IS_VARLEN: tl.constexpr, REVERSE: tl.constexpr,
):
    """Backward pass 3, one program per (sequence, head): dq, dk per query
    head [B,T,H,K] and dv per query head [B,T,H,V] from the primed parts;
    da [B,T,H,K] (or its sum over K, dg_head [B,T,H]), dgamma [N,H] and
    db [B,T,H,V] by reverse cumulative sums."""
    i_nh = tl.program_id(0)
    i_n, i_h = i_nh // H, i_nh % H
    i_hk = i_h // (H // HK)
    bos, eos = seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)
    o_k = tl.arange(0, BK)
    o_v = tl.arange(0, BVF)
    mask_k, mask_v = o_k < K, o_v < V
    KGATE: tl.constexpr = (G_MODE > 0) or USE_GK or (GAMMA_MODE > 0)

    acc_a = tl.zeros([BK], dtype=tl.float32)
    acc_b = tl.zeros([BVF], dtype=tl.float32)
    acc_gamma = tl.zeros([BK], dtype=tl.float32)
    if USE_DHT:
        if KGATE:
            for j in tl.static_range(NV):
                acc_a += tl.load(dfa + (i_nh * NV + j) * K + o_k, mask=mask_k, other=0.)
        if USE_GV:
            acc_b += tl.load(dfb + i_nh * V + o_v, mask=mask_v, other=0.)
    for i in range(0, eos - bos):
        if REVERSE:
            row = bos + i
        else:
            row = eos - 1 - i
        b_dq = tl.zeros([BK], dtype=tl.float32)
        b_dk = tl.zeros([BK], dtype=tl.float32)
        for j in tl.static_range(NV):
            p_part = ((row * H + i_h) * NV + j) * K + o_k
            b_dq += tl.load(dq_part + p_part, mask=mask_k, other=0.)
            b_dk += tl.load(dk_part + p_part, mask=mask_k, other=0.)
        b_q = tl.load(q + (row * H + i_h) * K + o_k, mask=mask_k, other=0.).to(tl.float32)
        b_k = tl.load(k + (row * HK + i_hk) * K + o_k, mask=mask_k, other=0.).to(tl.float32)
        b_v = tl.load(v + (row * HK + i_hk) * V + o_v, mask=mask_v, other=0.).to(tl.float32)
        b_do = tl.load(do + (row * H + i_h) * V + o_v, mask=mask_v, other=0.).to(tl.float32)
        b_dv = tl.load(dv_part + (row * H + i_h) * V + o_v, mask=mask_v, other=0.)
        vdo = tl.sum(b_v * b_do, axis=0) * scale
        tl.store(dq + (row * H + i_h) * K + o_k, b_dq + b_k * vdo, mask=mask_k)
        tl.store(dk_h + (row * H + i_h) * K + o_k, b_dk + b_q * vdo, mask=mask_k)
        tl.store(dv_h + (row * H + i_h) * V + o_v,
                 b_dv + tl.sum(b_q * b_k, axis=0) * scale * b_do, mask=mask_v)
        if KGATE:
            acc_a += b_q * b_dq - b_k * b_dk
            if (G_MODE == 2) or USE_GK:
                tl.store(da + (row * H + i_h) * K + o_k, acc_a, mask=mask_k)
            if G_MODE == 1:
                tl.store(dg_head + row * H + i_h, tl.sum(acc_a, axis=0))
            if GAMMA_MODE > 0:
                acc_gamma += acc_a
        if USE_GV:
            acc_b += tl.load(odo + (row * H + i_h) * V + o_v, mask=mask_v, other=0.) - b_v * b_dv
            tl.store(db + (row * H + i_h) * V + o_v, acc_b, mask=mask_v)
    if GAMMA_MODE > 0:
        tl.store(dgamma + i_nh, tl.sum(acc_gamma, axis=0))


# ---------------------------------------------------------------- launch plans

def config(plan) -> dict:
    """Block sizes: all of K in one block, V split so the fp32 state tile holds
    at most 4096 values (16-32 registers a thread at 4 warps)."""
    check_k(plan, "fused_recurrent")
    BK = next_pow2(plan.K)
    BV = min(next_pow2(plan.V), max(16, 4096 // BK))
    NV = -(-plan.V // BV)
    return dict(BK=BK, BV=BV, NV=NV, BVF=next_pow2(plan.V),
                num_warps=4 if BK * BV >= 2048 else 2)


def forward_launches(plan) -> list:
    """Reads q, k, v, [g, gk, gv, g_gamma, initial_state, cu_seqlens];
    writes o [B,T,H,V] (q's dtype) and final_state [N,H,K,V] fp32."""
    c = config(plan)
    B, T, H, K, V, N = plan.B, plan.T, plan.H, plan.K, plan.V, plan.N
    return [Launch(
        fused_recurrent_fwd_kernel, grid=(c["NV"], N * H),
        inputs=("q", "k", "v", *gate_inputs(plan),
                "initial_state" if plan.initial_state else None,
                "cu_seqlens" if plan.varlen else None, None),
        scalars=(plan.scale, T),
        outputs=(Out("o", (B, T, H, V), "like:q"), Out("final_state", (N, H, K, V)), None, None),
        constexprs=dict(flags(plan), BK=c["BK"], BV=c["BV"], NV=c["NV"],
                        USE_H0=plan.initial_state, DQ=False),
        num_warps=c["num_warps"])]


def backward_launches(plan, use_dht: bool) -> list:
    """Reads the forward inputs, final_state, do [B,T,H,V] and (use_dht)
    dfinal_state [N,H,K,V]; writes the fp32 buffers `gradients` reads."""
    c = config(plan)
    return three_pass_backward(plan, use_dht, fused_recurrent_fwd_kernel,
                               fused_recurrent_bwd_dkv_kernel,
                               dict(BK=c["BK"], BV=c["BV"], NV=c["NV"]), c["num_warps"],
                               combine_bk=c["BK"], bvf=c["BVF"])


def three_pass_backward(plan, use_dht, fwd_kernel, dkv_kernel, blocks, num_warps,
                        combine_bk, bvf) -> list:
    """The backward of a kernel family whose forward kernel has the DQ pass and
    whose dkv kernel has fused_recurrent_bwd_dkv_kernel's signature: pass 1
    (dq' partials, o'*do), pass 2 (dk', dv', d initial_state, final-state gate
    terms), then this module's combine kernel (see the module docstring)."""
    B, T, H, K, V, N, NV = plan.B, plan.T, plan.H, plan.K, plan.V, plan.N, blocks["NV"]
    kgate = key_gated(plan)
    final_terms = use_dht and (kgate or plan.gv)
    fl = flags(plan)
    gates = gate_inputs(plan)
    cu = "cu_seqlens" if plan.varlen else None
    return [
        Launch(fwd_kernel, grid=(NV, N * H),
               inputs=("q", "k", "v", *gates, "initial_state" if plan.initial_state else None,
                       cu, "do"),
               scalars=(plan.scale, T),
               outputs=(None, None, Out("dq_part", (B, T, H, NV, K)),
                        Out("odo", (B, T, H, V)) if plan.gv else None),
               constexprs=dict(fl, **blocks, USE_H0=plan.initial_state, DQ=True),
               num_warps=num_warps),
        Launch(dkv_kernel, grid=(NV, N * H),
               inputs=("q", "k", "v", *gates, "final_state" if final_terms else None, cu, "do",
                       "dfinal_state" if use_dht else None),
               scalars=(plan.scale, T),
               outputs=(Out("dk_part", (B, T, H, NV, K)), Out("dv_part", (B, T, H, V)),
                        Out("d_initial_state", (N, H, K, V)) if plan.initial_state else None,
                        Out("dfa", (N, H, NV, K)) if final_terms and kgate else None,
                        Out("dfb", (N, H, V)) if final_terms and plan.gv else None),
               constexprs=dict(fl, **blocks, USE_H0=plan.initial_state, USE_DHT=use_dht,
                               FINAL_TERMS=final_terms),
               num_warps=num_warps),
        Launch(fused_recurrent_bwd_combine_kernel, grid=(N * H,),
               inputs=("q", "k", "v", "do", cu, "dq_part", "dk_part", "dv_part",
                       "odo" if plan.gv else None,
                       "dfa" if final_terms and kgate else None,
                       "dfb" if final_terms and plan.gv else None),
               scalars=(plan.scale, T),
               outputs=(Out("dq", (B, T, H, K)), Out("dk_h", (B, T, H, K)),
                        Out("dv_h", (B, T, H, V)),
                        Out("da", (B, T, H, K)) if plan.g == "key" or plan.gk else None,
                        Out("dg_head", (B, T, H)) if plan.g == "head" else None,
                        Out("dgamma", (N, H)) if plan.g_gamma != "none" else None,
                        Out("db", (B, T, H, V)) if plan.gv else None),
               constexprs=dict(fl, BK=combine_bk, BVF=bvf, NV=NV, USE_DHT=use_dht),
               num_warps=1),
    ]
