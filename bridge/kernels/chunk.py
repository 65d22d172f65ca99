"""Chunked Triton kernels (mode="chunk"): the sequence is cut into blocks of
BT = 16 tokens in processing order (backwards with `reverse`); inside a block
the work is matrix products (tl.dot, fp32 "ieee"), between blocks the fp32
state [K, BV] is carried in registers by one program per (value block,
sequence x head).

Precision (strong gates, e.g. -5..-10 a step): with A_t, B_t the cumulative
log decays over K and V from the block start (inclusive, <= 0 and falling),
every factor is exp of a non-positive number: exp(A_t) from the block start,
exp(A_e - A_t) to the block end e, exp(A_t - A_j) for j < t; the last is
built one source column j at a time, so no running sum over more than 16
steps is ever differenced and nothing overflows.

The quantities are those of fused_recurrent.py's docstring (same notation):
  forward      o_t  = scale q_t S_t,
  DQ pass      dq'_t = scale S~_t do_t and o'_t = scale q_t S~_t (for gv),
  reverse pass dk'_t = dS~_t v_t, dv'_t = k_t dS~_t, d(initial_state),
and fused_recurrent's combine kernel turns them into dq, dk, dv and the
gate gradients (reverse cumulative sums with the step's own q.k term left out).

Layout: every tensor is [B, T, H, *] contiguous; `rows` are flat token
indices b*T + t (or packed indices with cu_seqlens), gathered per block so
that reverse and varlen need no copies. Masked rows read as 0 (gates 0 too)
and are never stored.

All matmul operands are fp32 (gated products are fp32 anyway), which also
keeps the interpreter's broken bf16 tl.dot out of every path.
"""

import triton
import triton.language as tl

from ..launch import Launch, Out
from .common import flags as _flags, gate_inputs as _gate_inputs, head_gamma as _gamma, seq_bounds as _bounds
from .fused_recurrent import three_pass_backward

MAX_K = 256
BT = 16  # block length: cumulative gates span at most 16 steps


@triton.jit
def _block_rows(bos, eos, p0, BT: tl.constexpr, REVERSE: tl.constexpr):
    """Token rows [BT] of processing positions p0..p0+BT-1 and their mask
    (masked rows point at bos so every address stays in bounds)."""
    p = p0 + tl.arange(0, BT)
    mask = p < (eos - bos)
    if REVERSE:
        rows = eos - 1 - p
    else:
        rows = bos + p
    return tl.where(mask, rows, bos), mask


@triton.jit
def _load_tile(x, rows, i_h, o_d, mask_t, mask_d, HX: tl.constexpr, D: tl.constexpr):
    """x[rows, i_h, o_d] as fp32 [BT, BD], zeros where masked."""
    ptr = x + (rows[:, None] * HX + i_h) * D + o_d[None, :]
    return tl.load(ptr, mask=mask_t[:, None] & mask_d[None, :], other=0.).to(tl.float32)


@triton.jit
def _cum_gates(g, gk, gv, gamma, rows, mask_t, i_h, o_k, mask_k, o_v, mask_v,
               H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
               BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
               G_MODE: tl.constexpr, USE_GK: tl.constexpr, USE_GV: tl.constexpr,
               GAMMA_MODE: tl.constexpr):
    """Inclusive cumulative log decays in the block: A [BT, BK], B [BT, BV],
    and their block totals A_e [BK], B_e [BV] (masked rows add 0)."""
    a = tl.zeros([BT, BK], dtype=tl.float32)
    if G_MODE == 1:
        a += tl.load(g + rows * H + i_h, mask=mask_t, other=0.).to(tl.float32)[:, None]
    if G_MODE == 2:
        a += _load_tile(g, rows, i_h, o_k, mask_t, mask_k, H, K)
    if USE_GK:
        a += _load_tile(gk, rows, i_h, o_k, mask_t, mask_k, H, K)
    if GAMMA_MODE > 0:
        a += tl.where(mask_t, gamma, 0.)[:, None]
    b = tl.zeros([BT, BV], dtype=tl.float32)
    if USE_GV:
        b += _load_tile(gv, rows, i_h, o_v, mask_t, mask_v, H, V)
    return tl.cumsum(a, axis=0), tl.cumsum(b, axis=0), tl.sum(a, axis=0), tl.sum(b, axis=0)


@triton.jit
def _row(x, o_t, j):
    """Row j of a [BT, D] register tile, as [D] (exact: the other rows add 0)."""
    return tl.sum(tl.where((o_t == j)[:, None], x, 0.), axis=0)


@triton.jit
def chunk_fwd_kernel(
    q, k, v, g, gk, gv, g_gamma, h0, cu_seqlens, do,
    scale, T,
    o, ht, dq, odo,
    H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr,
    G_MODE: tl.constexpr, USE_GK: tl.constexpr, USE_GV: tl.constexpr, GAMMA_MODE: tl.constexpr,
    USE_H0: tl.constexpr, IS_VARLEN: tl.constexpr, REVERSE: tl.constexpr, DQ: tl.constexpr,
):
    """Forward over blocks. DQ=False: o [B,T,H,V], ht [N,H,K,V]. DQ=True
    (backward pass 1): dq' partials [B,T,H,NV,K] and, with gv, o'*do
    [B,T,H,V] in fp32."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    i_hk = i_h // (H // HK)
    bos, eos = _bounds(cu_seqlens, i_n, T, IS_VARLEN)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k, mask_v = o_k < K, o_v < V
    mask_h = mask_k[:, None] & mask_v[None, :]
    gamma = _gamma(g_gamma, i_n, i_h, H, GAMMA_MODE)

    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        b_h += tl.load(h0 + (i_nh * K + o_k[:, None]).to(tl.int64) * V + o_v[None, :],
                       mask=mask_h, other=0.).to(tl.float32)
    for p0 in range(0, eos - bos, BT):
        rows, mask_t = _block_rows(bos, eos, p0, BT, REVERSE)
        b_q = _load_tile(q, rows, i_h, o_k, mask_t, mask_k, H, K)
        b_k = _load_tile(k, rows, i_hk, o_k, mask_t, mask_k, HK, K)
        b_v = _load_tile(v, rows, i_hk, o_v, mask_t, mask_v, HK, V)
        A, B, A_e, B_e = _cum_gates(g, gk, gv, gamma, rows, mask_t, i_h, o_k, mask_k, o_v,
                                    mask_v, H, K, V, BT, BK, BV, G_MODE, USE_GK, USE_GV,
                                    GAMMA_MODE)
        e_A, e_B = tl.exp(A), tl.exp(B)
        # the state carried in from earlier blocks
        b_o = tl.dot(b_q * e_A, b_h, input_precision="ieee") * e_B * scale
        if DQ:
            b_do = _load_tile(do, rows, i_h, o_v, mask_t, mask_v, H, V)
            b_dq = tl.dot(b_do * e_B, tl.trans(b_h), input_precision="ieee") * e_A * scale
        # inside the block, one source column j at a time (exponents A_t - A_j <= 0);
        # the primed quantities leave out the step's own token (t > j), o keeps it (t >= j)
        for j in range(0, BT):
            if DQ:
                causal = (o_t > j)[:, None]
            else:
                causal = (o_t >= j)[:, None]
            k_j, v_j = _row(b_k, o_t, j), _row(b_v, o_t, j)
            d_A = tl.exp(tl.where(causal, A - _row(A, o_t, j)[None, :], 0.))
            d_B = tl.exp(tl.where(causal, B - _row(B, o_t, j)[None, :], 0.))
            if DQ:
                c = tl.sum(tl.where(causal, d_B * v_j[None, :] * b_do, 0.), axis=1)
                b_dq += (scale * c)[:, None] * k_j[None, :] * d_A
            if (not DQ) or USE_GV:
                s = tl.sum(tl.where(causal, b_q * k_j[None, :] * d_A, 0.), axis=1)
                b_o += (scale * s)[:, None] * v_j[None, :] * d_B
        if DQ:
            tl.store(dq + ((rows[:, None] * H + i_h) * NV + i_v) * K + o_k[None, :], b_dq,
                     mask=mask_t[:, None] & mask_k[None, :])
            if USE_GV:
                tl.store(odo + (rows[:, None] * H + i_h) * V + o_v[None, :], b_o * b_do,
                         mask=mask_t[:, None] & mask_v[None, :])
        else:
            tl.store(o + (rows[:, None] * H + i_h) * V + o_v[None, :],
                     b_o.to(o.dtype.element_ty), mask=mask_t[:, None] & mask_v[None, :])
        # state at the block end: exponents A_e - A_t <= 0
        b_kd = b_k * tl.exp(A_e[None, :] - A)
        b_vd = b_v * tl.exp(B_e[None, :] - B)
        b_h = (b_h * tl.exp(A_e)[:, None] * tl.exp(B_e)[None, :]
               + tl.dot(tl.trans(b_kd), b_vd, input_precision="ieee"))
    if not DQ:
        tl.store(ht + (i_nh * K + o_k[:, None]).to(tl.int64) * V + o_v[None, :], b_h, mask=mask_h)


@triton.jit
def chunk_bwd_dkv_kernel(
    q, k, v, g, gk, gv, g_gamma, ht, cu_seqlens, do, dht,
    scale, T,
    dk, dv, dh0, dfa, dfb,
    H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr,
    G_MODE: tl.constexpr, USE_GK: tl.constexpr, USE_GV: tl.constexpr, GAMMA_MODE: tl.constexpr,
    USE_H0: tl.constexpr, USE_DHT: tl.constexpr, IS_VARLEN: tl.constexpr, REVERSE: tl.constexpr,
    FINAL_TERMS: tl.constexpr,
):
    """Backward pass 2, blocks from last to first carrying C = dS~ at the
    block end: dk' partials [B,T,H,NV,K], dv' per query head [B,T,H,V],
    dh0 [N,H,K,V]; with FINAL_TERMS the final-state gate terms
    sum_j dS_T*S_T [N,H,NV,K] and sum_i dS_T*S_T [N,H,V]."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    i_hk = i_h // (H // HK)
    bos, eos = _bounds(cu_seqlens, i_n, T, IS_VARLEN)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k, mask_v = o_k < K, o_v < V
    mask_h = mask_k[:, None] & mask_v[None, :]
    p_state = (i_nh * K + o_k[:, None]).to(tl.int64) * V + o_v[None, :]
    gamma = _gamma(g_gamma, i_n, i_h, H, GAMMA_MODE)

    b_c = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_DHT:
        b_c += tl.load(dht + p_state, mask=mask_h, other=0.).to(tl.float32)
        if FINAL_TERMS:
            b_last = b_c * tl.load(ht + p_state, mask=mask_h, other=0.)
            if (G_MODE > 0) or USE_GK or (GAMMA_MODE > 0):
                tl.store(dfa + (i_nh * NV + i_v) * K + o_k, tl.sum(b_last, axis=1), mask=mask_k)
            if USE_GV:
                tl.store(dfb + i_nh * V + o_v, tl.sum(b_last, axis=0), mask=mask_v)
    nb = tl.cdiv(eos - bos, BT)
    for ib in range(0, nb):
        rows, mask_t = _block_rows(bos, eos, (nb - 1 - ib) * BT, BT, REVERSE)
        b_q = _load_tile(q, rows, i_h, o_k, mask_t, mask_k, H, K)
        b_k = _load_tile(k, rows, i_hk, o_k, mask_t, mask_k, HK, K)
        b_v = _load_tile(v, rows, i_hk, o_v, mask_t, mask_v, HK, V)
        b_do = _load_tile(do, rows, i_h, o_v, mask_t, mask_v, H, V)
        A, B, A_e, B_e = _cum_gates(g, gk, gv, gamma, rows, mask_t, i_h, o_k, mask_k, o_v,
                                    mask_v, H, K, V, BT, BK, BV, G_MODE, USE_GK, USE_GV,
                                    GAMMA_MODE)
        e_Ae = tl.exp(A_e[None, :] - A)
        e_Be = tl.exp(B_e[None, :] - B)
        # through the gradient carried in from later blocks
        b_dk = tl.dot(b_v * e_Be, tl.trans(b_c), input_precision="ieee") * e_Ae
        b_dv = tl.dot(b_k * e_Ae, b_c, input_precision="ieee") * e_Be
        # later outputs i > t of this block, one at a time (exponents A_i - A_t <= 0)
        for i in range(0, BT):
            earlier = (o_t < i)[:, None]
            q_i, do_i = _row(b_q, o_t, i), _row(b_do, o_t, i)
            d_A = tl.exp(tl.where(earlier, _row(A, o_t, i)[None, :] - A, 0.))
            d_B = tl.exp(tl.where(earlier, _row(B, o_t, i)[None, :] - B, 0.))
            w = tl.sum(tl.where(earlier, do_i[None, :] * d_B * b_v, 0.), axis=1)
            b_dk += (scale * w)[:, None] * q_i[None, :] * d_A
            u = tl.sum(tl.where(earlier, b_k * q_i[None, :] * d_A, 0.), axis=1)
            b_dv += (scale * u)[:, None] * do_i[None, :] * d_B
        tl.store(dk + ((rows[:, None] * H + i_h) * NV + i_v) * K + o_k[None, :], b_dk,
                 mask=mask_t[:, None] & mask_k[None, :])
        tl.store(dv + (rows[:, None] * H + i_h) * V + o_v[None, :], b_dv,
                 mask=mask_t[:, None] & mask_v[None, :])
        # C at the previous block's end: exponents A_t (from this block's start) <= 0
        b_c = (b_c * tl.exp(A_e)[:, None] * tl.exp(B_e)[None, :]
               + tl.dot(tl.trans(b_q * tl.exp(A) * scale), b_do * tl.exp(B),
                        input_precision="ieee"))
    if USE_H0:
        tl.store(dh0 + p_state, b_c, mask=mask_h)


# ---------------------------------------------------------------- launch plans

def _next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def config(plan) -> dict:
    """Block sizes: all of K in one block (>= 16 for tl.dot), V split so the
    fp32 state tile holds at most 2048 values; 8 warps from 64x32 tiles on
    (measured with bridge.aot: 4 warps or 4096-value tiles spill at K = 64)."""
    if plan.K > MAX_K:
        raise ValueError(f"q: mode='chunk' supports K <= {MAX_K}, got K={plan.K}")
    BK = max(16, _next_pow2(plan.K))
    BV = max(16, min(_next_pow2(plan.V), 2048 // BK))
    NV = -(-plan.V // BV)
    return dict(BT=BT, BK=BK, BV=BV, NV=NV, BVF=_next_pow2(plan.V),
                num_warps=8 if BK * BV >= 2048 or BK >= 128 else 4)


def forward_launches(plan) -> list:
    """Reads q, k, v, [g, gk, gv, g_gamma, initial_state, cu_seqlens];
    writes o [B,T,H,V] (q's dtype) and final_state [N,H,K,V] fp32."""
    c = config(plan)
    B, T, H, K, V, N = plan.B, plan.T, plan.H, plan.K, plan.V, plan.N
    return [Launch(
        chunk_fwd_kernel, grid=(c["NV"], N * H),
        inputs=("q", "k", "v", *_gate_inputs(plan),
                "initial_state" if plan.initial_state else None,
                "cu_seqlens" if plan.varlen else None, None),
        scalars=(plan.scale, T),
        outputs=(Out("o", (B, T, H, V), "like:q"), Out("final_state", (N, H, K, V)), None, None),
        constexprs=dict(_flags(plan), BT=c["BT"], BK=c["BK"], BV=c["BV"], NV=c["NV"],
                        USE_H0=plan.initial_state, DQ=False),
        num_warps=c["num_warps"])]


def backward_launches(plan, use_dht: bool) -> list:
    """Reads the forward inputs, final_state, do [B,T,H,V] and (use_dht)
    dfinal_state [N,H,K,V]; writes the fp32 buffers bridge.grads reads. The
    per-token combine and reverse cumulative gate sums are fused_recurrent's."""
    c = config(plan)
    return three_pass_backward(plan, use_dht, chunk_fwd_kernel, chunk_bwd_dkv_kernel,
                               dict(BT=c["BT"], BK=c["BK"], BV=c["BV"], NV=c["NV"]),
                               c["num_warps"], combine_bk=_next_pow2(plan.K), bvf=c["BVF"])
