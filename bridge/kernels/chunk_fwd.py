"""Forward kernels of mode="chunk" (the GPU layout), also run by its backward.

Chunks of BT = 64 tokens in processing order; grids are one axis (program ids
unflattened in the kernel, so no axis meets CUDA's 65,535 limit on y and z):
  chunk_gate_kernel    parallel over (chunk, head, D block): the state pass's
                       operand gated to its chunk's end (forward: k, v) or from
                       its start (backward: q scale, do), and e^(chunk's decay);
  chunk_state_kernel   sequential over chunks only, one program per (K block,
                       V block, sequence x head): S <- decay S + x^T y, storing
                       the state at every chunk start h [slots, H, K, V] and the
                       final state (forward), or the state gradient at every
                       chunk end dh and d(initial_state) (BACKWARD=True);
  chunk_intra_kernel   parallel over (chunk, head): the intra-chunk matrix
                       A [B, T, H, BT], A[t, s] = scale sum_k q_t k_s
                       exp(sum_{s<r<=t} a_r) for s <= t;
  chunk_output_kernel  parallel over (chunk, head, V block):
                       o = scale (q gated) h + A v (gv: by levels, see below).
Every tl.dot takes operands in the input dtype (bf16/fp16 -> tensor cores) with
fp32 accumulation; fp32 inputs use DOT_PREC ("ieee" unless tf32 was asked for); for
fp16 the products of the state and of A (stored fp32) are tf32 (common.op_dot: a state
or a pair product passes fp16's range).
Exponentials are exp2 of log2e-scaled sums (one MUFU.EX2 each).

Precision with strong gates: every exponent is a sum of consecutive log decays,
<= 0 for gates <= 0 (never a difference of two running sums, which cancels),
and no exponent is differenced at all. The sums are products c @ a with 0/1
matrices c (common.seg_sums, on tensor cores, exact fp32 sums of the decays'
own values) over aligned segments of the chunk: within a chunk, a pair s < t
whose highest differing position bit is h (its "level") has t in an odd
segment of h and s in the even one before it, so exp(sum_{s<r<=t} a_r) =
exp(t's sum from its segment's start) exp(s's sum to its segment's end). One
product per level (log2(BT) of them) then gives all of A: q and k rows scaled by
their side's factor, the level's pairs kept from q k^T.
"""

import triton
import triton.language as tl

from .common import (block_pos, decay_k_in, exact_dtype, exp_, first_slot, head_gamma,
                     level_mask, load_qk_tile, load_tile, op_dtype, seg_matrix, seg_sums,
                     seq_bounds, slot_chunk, op_dot, tile_ptrs, wide_dtype)


@triton.jit
def chunk_gate_kernel(
    x, g, gk, gv, g_gamma, cu_seqlens,
    scale, T, N,
    xg, decay,
    H: tl.constexpr, HX: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
    G_MODE: tl.constexpr, USE_GK: tl.constexpr, GAMMA_MODE: tl.constexpr,
    IS_VARLEN: tl.constexpr, REVERSE: tl.constexpr, LOG_N: tl.constexpr,
    VALUE: tl.constexpr, BACKWARD: tl.constexpr,
):
    """The state pass's gated operand for one chunk, head and D block (parallel,
    before it): forward, x gated to the chunk's end, xg_t = x_t e^(sum_{r>t} a_r)
    (x = k, or v with VALUE); BACKWARD, gated from its start, xg_t = x_t
    e^(sum_{r<=t} a_r) (x = q times scale, or do). a: the key-side decays, or gv
    with VALUE. Also decay [slots, H, D] fp32 = e^(the chunk's sum of a).
    xg is [B,T,H,D] in xg's dtype; x has HX heads."""
    scale = tl.cast(scale, tl.float32)  # a float scalar may come as fp64 (common.py)
    ND: tl.constexpr = (D + BD - 1) // BD
    pid = tl.program_id(0)
    i_s, i_h, i_d = pid // (H * ND), (pid // ND) % H, pid % ND
    i_hx = i_h // (H // HX)
    i_n, bos, eos, p0 = slot_chunk(cu_seqlens, i_s, T, N, BT, IS_VARLEN, LOG_N)
    if p0 >= eos - bos:
        return
    o_t = tl.arange(0, BT)
    o_d = i_d * BD + tl.arange(0, BD)
    mask_d = o_d < D
    row0, pos, mask_t = block_pos(bos, eos, p0, BT, REVERSE)
    if VALUE:
        DT: tl.constexpr = exact_dtype(gv.dtype.element_ty, gv.dtype.element_ty, 0, True, 0)
        a = decay_k_in(DT, gv, gv, 0., row0, pos, mask_t, i_h, o_d, mask_d, H, D, 0, True, 0)
    else:
        DT: tl.constexpr = exact_dtype(g.dtype.element_ty, gk.dtype.element_ty, G_MODE, USE_GK,
                                       GAMMA_MODE)
        gamma = head_gamma(g_gamma, i_n, i_h, H, GAMMA_MODE)
        a = decay_k_in(DT, g, gk, gamma, row0, pos, mask_t, i_h, o_d, mask_d, H, D, G_MODE,
                       USE_GK, GAMMA_MODE)
    if BACKWARD:
        e = seg_sums(seg_matrix(o_t, 2 * BT, DT), a, DT)
    else:
        e = seg_sums(seg_matrix(o_t, BT, DT), a, DT)
    b_x = load_tile(x, row0, pos, i_hx, o_d, mask_t, mask_d, HX, D).to(tl.float32)
    if BACKWARD and not VALUE:
        b_x *= scale
    tl.store(tile_ptrs(xg, row0, pos, i_h, o_d, H, D), (b_x * exp_(e)).to(xg.dtype.element_ty),
             mask=mask_t[:, None] & mask_d[None, :])
    tl.store(decay + (i_s * H + i_h).to(tl.int64) * D + o_d, exp_(tl.sum(a.to(tl.float32), 0)),
             mask=mask_d)


@triton.jit
def chunk_state_kernel(
    x, y, decay_k, decay_v, g_gamma, s_in, cu_seqlens,
    scale, T,
    states, s_out,
    H: tl.constexpr, HX: tl.constexpr, HY: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    G_MODE: tl.constexpr, USE_GK: tl.constexpr, USE_GV: tl.constexpr, GAMMA_MODE: tl.constexpr,
    USE_S_IN: tl.constexpr, STORE_OUT: tl.constexpr, IS_VARLEN: tl.constexpr,
    REVERSE: tl.constexpr, BACKWARD: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """The sequential pass over one sequence's chunks, one program per (K block,
    V block, sequence x head), on operands gated by chunk_gate_kernel: a step is
    S <- decay_k S decay_v + x^T y. Forward (x = k, y = v, s_in = h0): states[slot
    c] = S at chunk c's start, s_out = the final state. Backward (x = q scale, y =
    do, s_in = dht), chunks last to first: states[slot c] = dS at chunk c's end,
    s_out = d(initial_state). x is pregated by g/gk (the decay_k of its chunk
    then multiplies S) and y by gv; a constant decay alone stays in the loop in
    closed form. s_in and s_out [N,H,K,V] fp32; states [slots,H,K,V] in its
    own dtype; x, y with HX, HY heads."""
    scale = tl.cast(scale, tl.float32)  # a float scalar may come as fp64 (common.py)
    NK: tl.constexpr = (K + BK - 1) // BK
    NV: tl.constexpr = (V + BV - 1) // BV
    pid = tl.program_id(0)
    i_nh, i_k, i_v = pid // (NK * NV), (pid // NV) % NK, pid % NV
    i_n, i_h = i_nh // H, i_nh % H
    PRE_K: tl.constexpr = (G_MODE > 0) or USE_GK
    bos, eos = seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)
    slot0 = first_slot(cu_seqlens, i_n, T, BT, IS_VARLEN)
    gamma = head_gamma(g_gamma, i_n, i_h, H, GAMMA_MODE)
    o_t = tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k, mask_v = o_k < K, o_v < V
    mask_h = mask_k[:, None] & mask_v[None, :]
    p_kv = o_k[:, None] * V + o_v[None, :]
    op: tl.constexpr = op_dtype(x.dtype.element_ty)

    b_s = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_S_IN:
        b_s += tl.load(s_in + i_nh.to(tl.int64) * K * V + p_kv, mask=mask_h,
                       other=0.).to(tl.float32)
    nt = tl.cdiv(eos - bos, BT)
    for it in range(0, nt):
        if BACKWARD:
            c = nt - 1 - it
        else:
            c = it
        slot = (slot0 + c) * H + i_h
        tl.store(states + slot * K * V + p_kv, b_s.to(states.dtype.element_ty), mask=mask_h)
        row0, pos, mask_t = block_pos(bos, eos, c * BT, BT, REVERSE)
        b_x = load_tile(x, row0, pos, i_h // (H // HX), o_k, mask_t, mask_k, HX, K).to(op)
        b_y = load_tile(y, row0, pos, i_h // (H // HY), o_v, mask_t, mask_v, HY, V).to(op)
        if PRE_K:
            b_s *= tl.load(decay_k + slot * K + o_k, mask=mask_k, other=0.)[:, None]
        elif GAMMA_MODE > 0:  # closed form: the decays are equal
            n_c = tl.minimum(eos - bos - c * BT, BT).to(tl.float32)
            if BACKWARD:
                f = exp_(gamma * (o_t + 1).to(tl.float32))
            else:
                f = exp_(gamma * tl.maximum(n_c - 1. - o_t.to(tl.float32), 0.))
            b_x = (b_x.to(tl.float32) * f[:, None]).to(op)
            b_s *= exp_(gamma * n_c)
        if BACKWARD and not PRE_K:
            b_x = (b_x.to(tl.float32) * scale).to(op)
        if USE_GV:
            b_s *= tl.load(decay_v + slot * V + o_v, mask=mask_v, other=0.)[None, :]
        b_s = tl.dot(tl.trans(b_x), b_y, b_s, input_precision=DOT_PREC)
    if STORE_OUT:
        tl.store(s_out + i_nh.to(tl.int64) * K * V + p_kv, b_s, mask=mask_h)


@triton.jit
def chunk_intra_kernel(
    q, k, g, gk, g_gamma, cu_seqlens,
    scale, T, N,
    A,
    H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr,
    G_MODE: tl.constexpr, USE_GK: tl.constexpr, GAMMA_MODE: tl.constexpr,
    IS_VARLEN: tl.constexpr, REVERSE: tl.constexpr, LOG_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """A [B,T,H,BT] of one chunk and head (columns are the chunk's positions, 0
    above the diagonal): A[t, s] = scale sum_k q_tk k_sk exp(sum_{s<r<=t} a_rk).

    Levels: a pair t > s whose highest differing position bit is h has t in an
    odd aligned segment of h and s in the even one just before it, so its
    exponent splits at their boundary into t's side (segment start..t) and s's
    side (s+1..segment end), both sums of consecutive decays, <= 0 (seg_sums).
    Each level is one product P P^T, P = q on odd-segment rows and k on even
    ones, times e^(its side's sum), whose level pairs are kept; log2(BT) levels,
    then the diagonal q_t.k_t."""
    scale = tl.cast(scale, tl.float32)  # a float scalar may come as fp64 (common.py)
    pid = tl.program_id(0)
    i_s, i_h = pid // H, pid % H
    i_hk = i_h // (H // HK)
    KGATE: tl.constexpr = (G_MODE > 0) or USE_GK or (GAMMA_MODE > 0)
    i_n, bos, eos, p0 = slot_chunk(cu_seqlens, i_s, T, N, BT, IS_VARLEN, LOG_N)
    if p0 >= eos - bos:
        return
    gamma = head_gamma(g_gamma, i_n, i_h, H, GAMMA_MODE)
    o_t = tl.arange(0, BT)
    row0, pos, mask_t = block_pos(bos, eos, p0, BT, REVERSE)
    op: tl.constexpr = op_dtype(q.dtype.element_ty)
    acc = tl.zeros([BT, BT], dtype=tl.float32)
    if KGATE:
        DT: tl.constexpr = exact_dtype(g.dtype.element_ty, gk.dtype.element_ty, G_MODE, USE_GK,
                                       GAMMA_MODE)
        for lvl in range(0, BT.bit_length() - 1):  # runtime: unrolled, every level's c was
            # built up front (live registers, spills)
            h = (BT // 2) >> lvl
            upper = (o_t & h) != 0
            c = seg_matrix(o_t, h, DT)
            d = tl.zeros([BT, BT], dtype=tl.float32)
            for i_k in range(0, tl.cdiv(K, BK)):
                o_k = i_k * BK + tl.arange(0, BK)
                mask_k = o_k < K
                b_x = load_qk_tile(q, k, row0, pos, i_h, i_hk, o_k, mask_t, upper, mask_k, H, HK,
                                   K)
                a = decay_k_in(DT, g, gk, gamma, row0, pos, mask_t, i_h, o_k, mask_k, H, K,
                               G_MODE, USE_GK, GAMMA_MODE)
                p = (b_x.to(tl.float32) * exp_(seg_sums(c, a, DT))).to(op)
                d = tl.dot(p, tl.trans(p), d, input_precision=DOT_PREC)
            acc = tl.where(level_mask(o_t, h), d, acc)
    d = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):  # no decay: the diagonal (all of A ungated)
        o_k = i_k * BK + tl.arange(0, BK)
        mask_k = o_k < K
        b_q = load_tile(q, row0, pos, i_h, o_k, mask_t, mask_k, H, K)
        b_k = load_tile(k, row0, pos, i_hk, o_k, mask_t, mask_k, HK, K)
        d = tl.dot(b_q.to(op), tl.trans(b_k.to(op)), d, input_precision=DOT_PREC)
    if KGATE:
        acc = tl.where(o_t[:, None] == o_t[None, :], d, acc)
    else:
        acc = tl.where(o_t[:, None] >= o_t[None, :], d, 0.)
    tl.store(tile_ptrs(A, row0, pos, i_h, o_t, H, BT), (acc * scale).to(A.dtype.element_ty),
             mask=mask_t[:, None])


@triton.jit
def chunk_output_kernel(
    q, v, g, gk, gv, g_gamma, A, h, cu_seqlens, do,
    scale, T, N,
    o,
    H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    G_MODE: tl.constexpr, USE_GK: tl.constexpr, USE_GV: tl.constexpr, GAMMA_MODE: tl.constexpr,
    IS_VARLEN: tl.constexpr, REVERSE: tl.constexpr, LOG_N: tl.constexpr,
    PRIME: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """o [B,T,H,V] (q's dtype) of one chunk, head and V block: o = scale (q gated
    from the chunk's start) h + A v. With gv the value decays of a pair (t, s)
    split at the boundary of its level (chunk_intra_kernel's levels): per level,
    o += X (A on the level's pairs) (v X), X = e^(seg_sums of gv); and the
    inter-chunk term is gated by the inclusive sums. PRIME (the backward's gv
    pass): o'_t * do_t in fp32 instead, o' leaving out the step's own token. fp16: the
    products with h and A tf32 (common.op_dot)."""
    scale = tl.cast(scale, tl.float32)  # a float scalar may come as fp64 (common.py)
    NV: tl.constexpr = (V + BV - 1) // BV
    pid = tl.program_id(0)
    i_s, i_h, i_v = pid // (H * NV), (pid // NV) % H, pid % NV
    i_hk = i_h // (H // HK)
    KGATE: tl.constexpr = (G_MODE > 0) or USE_GK or (GAMMA_MODE > 0)
    i_n, bos, eos, p0 = slot_chunk(cu_seqlens, i_s, T, N, BT, IS_VARLEN, LOG_N)
    if p0 >= eos - bos:
        return
    gamma = head_gamma(g_gamma, i_n, i_h, H, GAMMA_MODE)
    o_t = tl.arange(0, BT)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_v = o_v < V
    row0, pos, mask_t = block_pos(bos, eos, p0, BT, REVERSE)
    p_h = h + (i_s * H + i_h).to(tl.int64) * K * V
    op: tl.constexpr = op_dtype(q.dtype.element_ty)

    acc = tl.zeros([BT, BV], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        mask_k = o_k < K
        b_q = load_tile(q, row0, pos, i_h, o_k, mask_t, mask_k, H, K).to(tl.float32) * scale
        if KGATE:
            DT: tl.constexpr = exact_dtype(g.dtype.element_ty, gk.dtype.element_ty, G_MODE,
                                           USE_GK, GAMMA_MODE)
            a = decay_k_in(DT, g, gk, gamma, row0, pos, mask_t, i_h, o_k, mask_k, H, K, G_MODE,
                           USE_GK, GAMMA_MODE)
            b_q *= exp_(seg_sums(seg_matrix(o_t, 2 * BT, DT), a, DT))
        b_h = tl.load(p_h + o_k[:, None] * V + o_v[None, :],
                      mask=mask_k[:, None] & mask_v[None, :], other=0.)
        acc = op_dot(b_q.to(op), b_h, acc, op, DOT_PREC)
    wop: tl.constexpr = wide_dtype(op)
    b_a = load_tile(A, row0, pos, i_h, o_t, mask_t, o_t < BT, H, BT).to(wop)
    b_v = load_tile(v, row0, pos, i_hk, o_v, mask_t, mask_v, HK, V)
    if not USE_GV:
        acc = op_dot(b_a, b_v, acc, op, DOT_PREC)
    else:
        DV: tl.constexpr = exact_dtype(gv.dtype.element_ty, gv.dtype.element_ty, 0, True, 0)
        b = decay_k_in(DV, gv, gv, 0., row0, pos, mask_t, i_h, o_v, mask_v, H, V, 0, True, 0)
        acc *= exp_(seg_sums(seg_matrix(o_t, 2 * BT, DV), b, DV))
        b_vf = b_v.to(tl.float32)
        for lvl in range(0, BT.bit_length() - 1):  # runtime, as chunk_intra_kernel's
            hl = (BT // 2) >> lvl
            x = exp_(seg_sums(seg_matrix(o_t, hl, DV), b, DV))
            b_al = tl.where(level_mask(o_t, hl), b_a, 0.).to(wop)
            acc += x * op_dot(b_al, (b_vf * x).to(op), None, op, DOT_PREC)
        if not PRIME:
            acc = op_dot(tl.where(o_t[:, None] == o_t[None, :], b_a, 0.).to(wop), b_v, acc, op,
                         DOT_PREC)
    p_o = tile_ptrs(o, row0, pos, i_h, o_v, H, V)
    m_o = mask_t[:, None] & mask_v[None, :]
    if PRIME:
        b_do = load_tile(do, row0, pos, i_h, o_v, mask_t, mask_v, H, V).to(tl.float32)
        tl.store(p_o, acc * b_do, mask=m_o)
    else:
        tl.store(p_o, acc.to(o.dtype.element_ty), mask=m_o)
