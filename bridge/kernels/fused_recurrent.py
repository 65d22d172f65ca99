"""Fused recurrent kernels: one program per (value block, sequence x head), the
fp32 state [K, BV] in registers, a loop over time. The decoding and
short-sequence path. Grids put every program on axis x (value block fastest,
so a head's blocks run side by side and share its q/k rows in L2): CUDA allows
2^31 - 1 programs there but only 65,535 on y and z. Decays are exponentials of
one step's log gate, taken as exp2 of the gate times log2(e) (a single MUFU.EX2;
tl.exp adds a range fix-up around it).

Layout: every tensor is [B, T, H, *] contiguous (packed input is [1, total, H, *]);
`row` below is the flat token index b*T + t, or the packed index with cu_seqlens.

Backward (three launches, no stored per-step states). With S~_t = S_t - k_t^T v_t
(the state before step t adds its own token) and dS~_t = dS_t - scale q_t^T do_t
(the state gradient before step t adds its own output):
  1. the forward walk again, emitting dq'_t = scale S~_t do_t (partial per value
     block), with gv o'_t * do_t where o'_t = scale q_t S~_t, the final-state
     gate terms sum_j dS_T S~_T and sum_i dS_T S~_T, and with g_gamma its whole
     gradient (partial per value block, see below);
  2. a reverse walk of dS, emitting dk'_t = dS~_t v_t (partial per value block),
     dv'_t = k_t dS~_t per query head, and d(initial_state);
  3. a combine pass per (sequence, head): dq = dq' + scale k (v.do),
     dk = dk' + scale q (v.do), dv = dv' + scale (q.k) do, and the gate
     gradients from  dL/da_r = <dS_r, S~_r> summed over V, computed as
        dL/da_T = sum_j dS_T S~_T + q_T dq'_T,
        dL/da_r = dL/da_{r+1} + q_r dq'_r - k_r dk'_r   (r < T)
     and dL/db_r likewise with o'_r do_r - v_r dv'_r. Every term carries a decay
     factor (S~_r = e^{a_r} S_{r-1}, dS~_r = e^{a_{r+1}} dS_{r+1}), so strong
     decays make them small together with the result. The step's own q.k
     contribution, which would appear in both halves, is left out, and the final
     term uses S~_T from pass 1 rather than S_T: sum_j dS_T S_T - k_T dk'_T is the
     same number as a difference of two undecayed O(1) terms, which fp32 left as
     +-1e-7 where the gradient is exactly 0 (one step and no initial state: a
     relative error of 1e22 to a caller dividing by the true value). Without an
     initial state the first step's gate gradients are exactly 0 and stored so.
     g_gamma's gradient, a sum of these cumulative sums over every step, is
     not taken from them (position-weighted cancellation): pass 1 computes it in
     forward mode (see fused_recurrent_fwd_kernel).
"""

import dataclasses

import triton
import triton.language as tl

from .. import tuning
from ..launch import Launch, Out
from .common import check_k, flags, gate_inputs, head_gamma, next_pow2, seq_bounds, varlen_input


LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _log2_decay_k(g, gk, gamma, row, i_h, o_k, mask_k, H: tl.constexpr, K: tl.constexpr,
                  BK: tl.constexpr, G_MODE: tl.constexpr, USE_GK: tl.constexpr):
    """(g_t + gk_t + gamma) log2(e) over K, fp32 [BK]: exp2 of it is step t's decay."""
    a = tl.zeros([BK], dtype=tl.float32) + gamma
    if G_MODE == 1:
        a += tl.load(g + row * H + i_h).to(tl.float32)
    if G_MODE == 2:
        a += tl.load(g + (row * H + i_h) * K + o_k, mask=mask_k, other=0.).to(tl.float32)
    if USE_GK:
        a += tl.load(gk + (row * H + i_h) * K + o_k, mask=mask_k, other=0.).to(tl.float32)
    return a * LOG2E


@triton.jit
def _program(NV: tl.constexpr):
    """(value block, sequence x head) of this program: all of them on grid axis x."""
    pid = tl.program_id(0)
    return pid % NV, pid // NV


@triton.jit
def fused_recurrent_fwd_kernel(
    q, k, v, g, gk, gv, g_gamma, h0, cu_seqlens, do, dht,
    scale, T,
    o, ht, dq, odo, dfa, dfb, dgamma_part,
    H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr,
    G_MODE: tl.constexpr, USE_GK: tl.constexpr, USE_GV: tl.constexpr, GAMMA_MODE: tl.constexpr,
    USE_H0: tl.constexpr, IS_VARLEN: tl.constexpr, REVERSE: tl.constexpr, DQ: tl.constexpr,
    USE_DHT: tl.constexpr,
):
    """Forward walk. DQ=False: o [B,T,H,V], ht [N,H,K,V]. DQ=True (backward
    pass 1): dq' partials [B,T,H,NV,K]; with gv, o'*do [B,T,H,V] in fp32; with
    USE_DHT, the final-state terms sum_j dS_T S~_T [N,H,NV,K] (g or gk) and
    sum_i dS_T S~_T [N,H,V] (gv); with g_gamma, its gradient [N,H,NV]."""
    scale = tl.cast(scale, tl.float32)  # a float scalar may come as fp64 (common.py)
    i_v, i_nh = _program(NV)
    i_n, i_h = i_nh // H, i_nh % H
    i_hk = i_h // (H // HK)
    bos, eos = seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k, mask_v = o_k < K, o_v < V
    mask_h = mask_k[:, None] & mask_v[None, :]
    p_state = (i_nh * K + o_k[:, None]).to(tl.int64) * V + o_v[None, :]
    gamma = head_gamma(g_gamma, i_n, i_h, H, GAMMA_MODE)
    KGATE: tl.constexpr = (G_MODE > 0) or USE_GK or (GAMMA_MODE > 0)
    FINAL_A: tl.constexpr = DQ and USE_DHT and ((G_MODE > 0) or USE_GK)
    FINAL_B: tl.constexpr = DQ and USE_DHT and USE_GV
    # dL/dgamma in forward mode: with P_t = dS_t/dgamma = decay(P_{t-1}) + S~_t,
    # dL/dgamma = sum_t scale q_t P_t do_t + <dS_T, P_T>. The reverse-mode form,
    # sum over t of the reverse cumulative sums dL/da_t, weighs each token's
    # (fp32-rounded) q.dq' and k.dk' terms by its position: a pair of tokens s < t
    # contributes with weight t - s, computed as t*x - s*x. At 30 tokens that cost
    # 4e-5 relative error, growing with the length. P_t holds the weights t - s
    # directly, so nothing cancels beyond the sum over tokens itself.
    TANGENT: tl.constexpr = DQ and (GAMMA_MODE > 0)

    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        b_h += tl.load(h0 + p_state, mask=mask_h, other=0.).to(tl.float32)
    if TANGENT:
        b_p = tl.zeros([BK, BV], dtype=tl.float32)
        b_dgamma = tl.zeros([BK], dtype=tl.float32)
    # written here too so that an empty sequence leaves no unwritten buffer
    if FINAL_A:
        tl.store(dfa + (i_nh * NV + i_v) * K + o_k, tl.zeros([BK], dtype=tl.float32),
                 mask=mask_k)
    if FINAL_B:
        tl.store(dfb + i_nh * V + o_v, tl.zeros([BV], dtype=tl.float32), mask=mask_v)
    for i in range(0, eos - bos):
        if REVERSE:
            row = eos - 1 - i
        else:
            row = bos + i
        b_q = tl.load(q + (row * H + i_h) * K + o_k, mask=mask_k, other=0.).to(tl.float32)
        b_k = tl.load(k + (row * HK + i_hk) * K + o_k, mask=mask_k, other=0.).to(tl.float32)
        b_v = tl.load(v + (row * HK + i_hk) * V + o_v, mask=mask_v, other=0.).to(tl.float32)
        if KGATE:
            d_a = tl.exp2(_log2_decay_k(g, gk, gamma, row, i_h, o_k, mask_k, H, K, BK, G_MODE,
                                        USE_GK))
            b_h = b_h * d_a[:, None]
            if TANGENT:
                b_p = b_p * d_a[:, None]
        if USE_GV:
            b_b = tl.load(gv + (row * H + i_h) * V + o_v, mask=mask_v, other=0.).to(tl.float32)
            d_b = tl.exp2(b_b * LOG2E)
            b_h = b_h * d_b[None, :]
            if TANGENT:
                b_p = b_p * d_b[None, :]
        if DQ:  # b_h is S~_t here: the step's own token is not in yet
            b_do = tl.load(do + (row * H + i_h) * V + o_v, mask=mask_v, other=0.).to(tl.float32)
            b_dq = tl.sum(b_h * b_do[None, :], axis=1) * scale
            tl.store(dq + ((row * H + i_h) * NV + i_v) * K + o_k, b_dq, mask=mask_k)
            if USE_GV:
                b_o = tl.sum(b_h * b_q[:, None], axis=0) * scale
                tl.store(odo + (row * H + i_h) * V + o_v, b_o * b_do, mask=mask_v)
            if TANGENT:
                b_p += b_h
                b_dgamma += b_q * tl.sum(b_p * b_do[None, :], axis=1)
            if FINAL_A or FINAL_B:
                # pass 1 needs no S_T: leaving the last token out keeps S~_T for the
                # final-state terms (exactly: it adds 0 * v)
                b_k = tl.where(i == eos - bos - 1, 0., b_k)
        b_h += b_k[:, None] * b_v[None, :]
        if not DQ:
            b_o = tl.sum(b_h * b_q[:, None], axis=0) * scale
            tl.store(o + (row * H + i_h) * V + o_v, b_o.to(o.dtype.element_ty), mask=mask_v)
    if not DQ:  # not p_state: see the dht load below
        tl.store(ht + i_nh.to(tl.int64) * (K * V) + (o_k[:, None] * V + o_v[None, :]), b_h,
                 mask=mask_h)
    if DQ and USE_DHT and (FINAL_A or FINAL_B or TANGENT):
        # a scalar base and int32 offsets: rebuilding p_state's int64 tile here would keep
        # it alive across the loop (64 registers a thread at a 64 x 64 tile)
        b_dht = tl.load(dht + i_nh.to(tl.int64) * (K * V) + (o_k[:, None] * V + o_v[None, :]),
                        mask=mask_h, other=0.)
        if FINAL_A or FINAL_B:
            if eos > bos:  # b_h is S~_T
                b_last = b_dht * b_h
                if FINAL_A:
                    tl.store(dfa + (i_nh * NV + i_v) * K + o_k, tl.sum(b_last, axis=1),
                             mask=mask_k)
                if FINAL_B:
                    tl.store(dfb + i_nh * V + o_v, tl.sum(b_last, axis=0), mask=mask_v)
    if TANGENT:
        b_total = tl.sum(b_dgamma, axis=0) * scale
        if USE_DHT:
            b_total += tl.sum(tl.sum(b_dht * b_p, axis=1), axis=0)
        tl.store(dgamma_part + i_nh * NV + i_v, b_total)


@triton.jit
def fused_recurrent_bwd_dkv_kernel(
    q, k, v, g, gk, gv, g_gamma, cu_seqlens, do, dht,
    scale, T,
    dk, dv, dh0,
    H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr,
    G_MODE: tl.constexpr, USE_GK: tl.constexpr, USE_GV: tl.constexpr, GAMMA_MODE: tl.constexpr,
    USE_H0: tl.constexpr, USE_DHT: tl.constexpr, IS_VARLEN: tl.constexpr, REVERSE: tl.constexpr,
):
    """Backward pass 2: walk dS from the last step taken to the first.
    dk' partials [B,T,H,NV,K], dv' per query head [B,T,H,V], dh0 [N,H,K,V]."""
    scale = tl.cast(scale, tl.float32)  # a float scalar may come as fp64 (common.py)
    i_v, i_nh = _program(NV)
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
            b_a = _log2_decay_k(g, gk, gamma, row, i_h, o_k, mask_k, H, K, BK, G_MODE, USE_GK)
            b_dh = b_dh * tl.exp2(b_a)[:, None]
        if USE_GV:
            b_b = tl.load(gv + (row * H + i_h) * V + o_v, mask=mask_v, other=0.).to(tl.float32)
            b_dh = b_dh * tl.exp2(b_b * LOG2E)[None, :]
    if USE_H0:  # not p_state: see the dht load of fused_recurrent_fwd_kernel
        tl.store(dh0 + i_nh.to(tl.int64) * (K * V) + (o_k[:, None] * V + o_v[None, :]), b_dh,
                 mask=mask_h)


@triton.jit
def fused_recurrent_bwd_combine_kernel(
    q, k, v, do, cu_seqlens, dq_part, dk_part, dv_part, odo, dfa, dfb, dgamma_part,
    scale, T,
    dq, dk_h, dv_h, da, dg_head, dgamma, db,
    H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BVF: tl.constexpr, NV: tl.constexpr,
    G_MODE: tl.constexpr, USE_GK: tl.constexpr, USE_GV: tl.constexpr, GAMMA_MODE: tl.constexpr,
    USE_H0: tl.constexpr, USE_DHT: tl.constexpr, IS_VARLEN: tl.constexpr, REVERSE: tl.constexpr,
):
    """Backward pass 3, one program per (sequence, head): dq, dk per query
    head [B,T,H,K] and dv per query head [B,T,H,V] from the primed parts;
    da [B,T,H,K] (or its sum over K, dg_head [B,T,H]), dgamma [N,H] and
    db [B,T,H,V] by reverse cumulative sums. dfa / dfb hold dS_T S~_T (pass 1),
    so the last step's k dk' and v dv' (its dS_T part) are already out of them.
    dgamma is the sum of pass 1's partials [N,H,NV], not the sum of the
    cumulative sums (ill-conditioned, see fused_recurrent_fwd_kernel).
    Without USE_H0 the first step's gate gradients are exactly 0 (its gates
    decay a zero state); the cumulative sums would leave rounding noise there."""
    scale = tl.cast(scale, tl.float32)  # a float scalar may come as fp64 (common.py)
    i_nh = tl.program_id(0)
    i_n, i_h = i_nh // H, i_nh % H
    i_hk = i_h // (H // HK)
    bos, eos = seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)
    o_k = tl.arange(0, BK)
    o_v = tl.arange(0, BVF)
    mask_k, mask_v = o_k < K, o_v < V
    KGATE: tl.constexpr = (G_MODE > 0) or USE_GK
    n_steps = eos - bos

    acc_a = tl.zeros([BK], dtype=tl.float32)
    acc_b = tl.zeros([BVF], dtype=tl.float32)
    if USE_DHT:
        if KGATE:
            for j in tl.static_range(NV):
                acc_a += tl.load(dfa + (i_nh * NV + j) * K + o_k, mask=mask_k, other=0.)
        if USE_GV:
            acc_b += tl.load(dfb + i_nh * V + o_v, mask=mask_v, other=0.)
    for i in range(0, n_steps):
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
            acc_a += b_q * b_dq - tl.where(i > 0, b_k * b_dk, 0.)
            if not USE_H0:
                acc_a = tl.where(i == n_steps - 1, 0., acc_a)
            if (G_MODE == 2) or USE_GK:
                tl.store(da + (row * H + i_h) * K + o_k, acc_a, mask=mask_k)
            if G_MODE == 1:
                tl.store(dg_head + row * H + i_h, tl.sum(acc_a, axis=0))
        if USE_GV:
            acc_b += (tl.load(odo + (row * H + i_h) * V + o_v, mask=mask_v, other=0.)
                      - tl.where(i > 0, b_v * b_dv, 0.))
            if not USE_H0:
                acc_b = tl.where(i == n_steps - 1, 0., acc_b)
            tl.store(db + (row * H + i_h) * V + o_v, acc_b, mask=mask_v)
    if GAMMA_MODE > 0:
        b_gamma = 0.0
        for j in tl.static_range(NV):
            b_gamma += tl.load(dgamma_part + i_nh * NV + j)
        tl.store(dgamma + i_nh, b_gamma)


# ---------------------------------------------------------------- launch plans

# The launch sites the device table (bridge/tuning.py) may tune, each with the candidate
# values the GPU kit's sweep tries: "tiles" is the V block every launch shares (the
# state tile [K, BV]); the others each kernel's warps and stages (stages prefetch the
# next step's rows in the loop over time)
SITES = {
    "tiles": dict(BV=(16, 32, 64, 128)),
    "fused_recurrent_fwd_kernel": dict(num_warps=(2, 4, 8), num_stages=(1, 2, 3)),
    "fused_recurrent_fwd_kernel.dq": dict(num_warps=(2, 4, 8), num_stages=(1, 2, 3)),
    "fused_recurrent_bwd_dkv_kernel": dict(num_warps=(2, 4, 8), num_stages=(1, 2, 3)),
}


def config(plan) -> dict:
    """Block sizes: all of K in one block, V split so the fp32 state tile holds
    at most 4096 values (16-32 registers a thread at 4 warps), in blocks of at least
    16 (K = 512: 8192 values, still without spills; fewer would multiply the dq'/dk'
    partials, NV x K a token); the device table's "tiles" entry when it has one."""
    check_k(plan, "fused_recurrent")
    BK = next_pow2(plan.K)
    BV = tuning.pick(plan, "fused_recurrent", "tiles",
                     dict(BV=min(next_pow2(plan.V), max(16, 4096 // BK))))["BV"]
    NV = -(-plan.V // BV)
    return dict(BK=BK, BV=BV, NV=NV, BVF=next_pow2(plan.V),
                num_warps=4 if BK * BV >= 2048 else 2)


def _knobs(plan, site, num_warps) -> dict:
    """num_warps and num_stages of one launch site: `num_warps` and 1 stage, or the
    device table's entry."""
    return tuning.pick(plan, "fused_recurrent", site, dict(num_warps=num_warps, num_stages=1))


def forward_launches(plan, keep: bool = True) -> list:
    """Reads q, k, v, [g, gk, gv, g_gamma, initial_state, cu_seqlens];
    writes o [B,T,H,V] (q's dtype) and final_state [N,H,K,V] fp32 (`keep`: nothing is
    kept, `kept`)."""
    c = config(plan)
    B, T, H, K, V, N = plan.B, plan.T, plan.H, plan.K, plan.V, plan.N
    return _with_bytes(plan, [Launch(
        fused_recurrent_fwd_kernel, grid=(c["NV"] * N * H,),
        inputs=dict(q="q", k="k", v="v", **gate_inputs(plan),
                    h0="initial_state" if plan.initial_state else None, **varlen_input(plan),
                    do=None, dht=None),
        scalars=dict(scale=plan.scale, T=T),
        outputs=dict(o=Out("o", (B, T, H, V), "like:q"), ht=Out("final_state", (N, H, K, V)),
                     dq=None, odo=None, dfa=None, dfb=None, dgamma_part=None),
        constexprs=dict(flags(plan), BK=c["BK"], BV=c["BV"], NV=c["NV"],
                        USE_H0=plan.initial_state, DQ=False, USE_DHT=False),
        **_knobs(plan, "fused_recurrent_fwd_kernel", c["num_warps"]))])


def kept(plan) -> tuple:
    """The forward's buffers the backward reuses (see chunk.kept): none, its passes
    recompute the states."""
    return ()


def backward_launches(plan, use_dht: bool, kept: tuple = ()) -> list:
    """Reads the forward inputs, do [B,T,H,V] and (use_dht) dfinal_state
    [N,H,K,V]; writes the fp32 buffers `gradients` reads. The three passes of
    the module docstring; pass 1 also takes the final-state gate terms and the
    whole g_gamma gradient, so pass 2 needs no final_state. `kept` is `kept(plan)`:
    empty."""
    if kept:
        raise ValueError(f"kept: the fused recurrent backward reuses no forward buffer, "
                         f"got {kept}")
    c = config(plan)
    B, T, H, K, V, N, NV = plan.B, plan.T, plan.H, plan.K, plan.V, plan.N, c["NV"]
    blocks = dict(BK=c["BK"], BV=c["BV"], NV=NV)
    fl = flags(plan)
    gates, cu = gate_inputs(plan), varlen_input(plan)
    dht = "dfinal_state" if use_dht else None
    final_a = use_dht and (plan.g != "none" or plan.gk)
    final_b = use_dht and plan.gv
    gamma = plan.g_gamma != "none"
    return _with_bytes(plan, [
        Launch(fused_recurrent_fwd_kernel, grid=(NV * N * H,),
               inputs=dict(q="q", k="k", v="v", **gates,
                           h0="initial_state" if plan.initial_state else None, **cu, do="do",
                           dht=dht),
               scalars=dict(scale=plan.scale, T=T),
               outputs=dict(o=None, ht=None, dq=Out("dq_part", (B, T, H, NV, K)),
                            odo=Out("odo", (B, T, H, V)) if plan.gv else None,
                            dfa=Out("dfa", (N, H, NV, K)) if final_a else None,
                            dfb=Out("dfb", (N, H, V)) if final_b else None,
                            dgamma_part=Out("dgamma_part", (N, H, NV)) if gamma else None),
               constexprs=dict(fl, **blocks, USE_H0=plan.initial_state, DQ=True,
                               USE_DHT=use_dht),
               # the g_gamma tangent is a second state tile: twice the threads hold it
               # (sm_90, unhinted 64 x 64 tile: 255 registers a thread at 4 warps, 128 at 8)
               **_knobs(plan, "fused_recurrent_fwd_kernel.dq",
                        2 * c["num_warps"] if gamma else c["num_warps"])),
        Launch(fused_recurrent_bwd_dkv_kernel, grid=(NV * N * H,),
               inputs=dict(q="q", k="k", v="v", **gates, **cu, do="do", dht=dht),
               scalars=dict(scale=plan.scale, T=T),
               outputs=dict(dk=Out("dk_part", (B, T, H, NV, K)), dv=Out("dv_part", (B, T, H, V)),
                            dh0=Out("d_initial_state", (N, H, K, V))
                            if plan.initial_state else None),
               constexprs=dict(fl, **blocks, USE_H0=plan.initial_state, USE_DHT=use_dht),
               **_knobs(plan, "fused_recurrent_bwd_dkv_kernel", c["num_warps"])),
        _combine(plan, use_dht, NV, c["BK"], c["BVF"], "dfa" if final_a else None,
                 "dfb" if final_b else None, "dgamma_part" if gamma else None),
    ])


def _combine(plan, use_dht, NV, combine_bk, bvf, dfa, dfb, dgamma_part) -> Launch:
    B, T, H, K, V, N = plan.B, plan.T, plan.H, plan.K, plan.V, plan.N
    return Launch(
        fused_recurrent_bwd_combine_kernel, grid=(N * H,),
        inputs=dict(q="q", k="k", v="v", do="do", **varlen_input(plan), dq_part="dq_part",
                    dk_part="dk_part", dv_part="dv_part", odo="odo" if plan.gv else None,
                    dfa=dfa, dfb=dfb, dgamma_part=dgamma_part),
        scalars=dict(scale=plan.scale, T=T),
        outputs=dict(dq=Out("dq", (B, T, H, K)), dk_h=Out("dk_h", (B, T, H, K)),
                     dv_h=Out("dv_h", (B, T, H, V)),
                     da=Out("da", (B, T, H, K)) if plan.g == "key" or plan.gk else None,
                     dg_head=Out("dg_head", (B, T, H)) if plan.g == "head" else None,
                     dgamma=Out("dgamma", (N, H)) if plan.g_gamma != "none" else None,
                     db=Out("db", (B, T, H, V)) if plan.gv else None),
        constexprs=dict(flags(plan), BK=combine_bk, BVF=bvf, NV=NV, USE_H0=plan.initial_state,
                        USE_DHT=use_dht),
        # a warp per 256 values of its widest row: at K or V = 512 one warp spilled (sm_90)
        num_warps=max(1, max(combine_bk, bvf) // 256))


# ---------------------------------------------------------------- HBM traffic

def _with_bytes(plan, launches) -> list:
    """The launches with `bytes` filled: every tensor each one reads or writes,
    once, in its dtype (the call's tensors as `Plan.shape` / `Plan.tensor_dtype`
    give them; buffers of earlier launches as their Out says). A value block
    program re-reads q, k and the key gates of its row, from L2 where NV > 1: not
    counted. This family has no tl.dot, so dot_flops stays 0."""
    made = {}
    out = []
    for launch in launches:
        total = sum(made[n] if n in made else plan.nbytes(n) for n in launch.reads())
        for o in launch.writes():
            made[o.name] = o.nbytes(plan)
            total += made[o.name]
        out.append(dataclasses.replace(launch, bytes=total, dot_flops=0))
    return out
