"""Backward kernels of mode="chunk", on the forward's layout (chunk_fwd.py).

With h the state at each chunk start, dh the state gradient at each chunk end
(chunk_state_kernel run backwards) and A the intra-chunk matrix:
  chunk_dA_kernel     dA[t, s] = sum_v do_t v_s exp(B_t - B_s) (s <= t), one
                      program per (chunk, head); its first program also writes
                      the scan table (scan_matrix) the later launches read
  chunk_dv_kernel     dv = A^T do (gated) + (k gated) dh; with gv also the gate
                      gradient db from o'*do (chunk_output_kernel, PRIME) and v*dv'
  chunk_dqk_kernel    dq = scale (do gated) h^T + dA k (gated), dk = (v gated) dh^T
                      + dA^T q (gated), and the key-gate gradient da
  chunk_dgamma_kernel the constant decay's gradient per (sequence, head)

Decays by 0/1 matrices (the scan table and its products): chunk_scan.py.

Gate gradients (notation of fused_recurrent.py): da_r = sum_{t >= r}
(q dq' - k dk')_t + sum_V dh_end S_end, where the primed gradients leave out the
step's own q.k term (it would cancel in the difference, and fp32 would lose a
tiny gate gradient to that cancellation) and the second term carries everything
after the chunk. S_end = (h_start decayed over the chunk) + the chunk's own
k v^T terms, whose part sum_t k_t dk_state_t cancels the state part of dk' for
t >= r exactly: so da_r = sum_{t >= r} (q dq' - k dk_intra)_t + sum_{t < r}
(k dk_state)_t + exp(A_c) sum_V dh_end h_start exp(B_c), two table sums and no
cancelling terms (in fp16 the cancellation of separately rounded products lost
5-40x, issue 35). db likewise with o'*do - v*dv' and sums over K.
"""

import triton
import triton.language as tl

from .chunk_scan import (decay_pieces, levels_into, scan, scan_matrix, scan_v, sum_rows,
                         to_chunk_end)
from .common import (LOG2E, block_rows, decay_k, decay_v, first_slot, head_gamma, load_rows,
                     seq_bounds, slot_chunk, op_dot, split_pieces, wide_dtype)


@triton.jit
def chunk_dA_kernel(
    v, gv, do, cu_seqlens,
    T, N,
    dA, tab,
    H: tl.constexpr, HK: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BV: tl.constexpr,
    USE_GV: tl.constexpr, IS_VARLEN: tl.constexpr, REVERSE: tl.constexpr, LOG_N: tl.constexpr,
    LEVELS: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """dA [B,T,H,BT] fp32 (0 above the diagonal), one program per (chunk, head),
    and the scan table tab [2 LEVELS + 3, BT, BT] for the later launches
    (scan_matrix; written by the first program). With gv, pairs by levels as
    in levels_into: level l adds (do F_l)(v F_l)^T on its pairs, F_l from the
    value decays (its matrices made in registers: the table is being written)."""
    i_s, i_h = tl.program_id(0), tl.program_id(1)
    i_hk = i_h // (H // HK)
    op = v.dtype.element_ty
    sop = tab.dtype.element_ty  # the scan table's 16-bit dtype
    o_t = tl.arange(0, BT)
    if (i_s == 0) & (i_h == 0):
        for i in range(0, 2 * LEVELS + 3):
            tl.store(tab + i * BT * BT + o_t[:, None] * BT + o_t[None, :],
                     scan_matrix(i, BT, LEVELS, sop))
    i_n, bos, eos, p0 = slot_chunk(cu_seqlens, i_s, T, N, BT, IS_VARLEN, LOG_N)
    if p0 >= eos - bos:
        return
    rows, mask_t = block_rows(bos, eos, p0, BT, REVERSE)
    acc = tl.zeros([BT, BT], dtype=tl.float32)
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        mask_v = o_v < V
        b_do = load_rows(do, rows, i_h, o_v, mask_t, mask_v, H, V)
        b_v = load_rows(v, rows, i_hk, o_v, mask_t, mask_v, HK, V)
        if not USE_GV:
            acc += tl.dot(b_do.to(op), tl.trans(b_v.to(op)), input_precision=DOT_PREC)
        else:
            acc += tl.where(o_t[:, None] == o_t[None, :], tl.dot(
                b_do.to(op), tl.trans(b_v.to(op)), input_precision=DOT_PREC), 0.)
            PV: tl.constexpr = decay_pieces(sop, gv.dtype.element_ty, True)
            b0, b1, b2 = split_pieces(
                decay_v(gv, rows, mask_t, i_h, o_v, mask_v, H, V, True, BT, BV), sop, PV)
            for lw in range(0, LEVELS):
                f = tl.exp2(scan(tab, lw, b0, b1, b2, BT, PV, scan_matrix(lw, BT, LEVELS, sop))
                            * LOG2E)
                pair = scan_matrix(LEVELS + 2 + lw, BT, LEVELS, tl.float32)
                acc += pair * tl.dot(
                    (b_do.to(tl.float32) * f).to(op), tl.trans((b_v.to(tl.float32) * f).to(op)),
                    input_precision=DOT_PREC)
    acc = tl.where(o_t[:, None] >= o_t[None, :], acc, 0.)
    tl.store(dA + (rows[:, None] * H + i_h) * BT + o_t[None, :], acc, mask=mask_t[:, None])


@triton.jit
def chunk_dv_kernel(
    k, v, g, gk, gv, g_gamma, A, h, dh, odo, tab, cu_seqlens, do,
    T, N,
    dv, db,
    H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    G_MODE: tl.constexpr, USE_GK: tl.constexpr, USE_GV: tl.constexpr, GAMMA_MODE: tl.constexpr,
    USE_H0: tl.constexpr, IS_VARLEN: tl.constexpr, REVERSE: tl.constexpr, LOG_N: tl.constexpr,
    LEVELS: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """dv per query head [B,T,H,V] for one chunk and V block (one block at
    V <= 128 for 16-bit inputs); with gv also db [B,T,H,V] fp32, the pairs
    inside the chunk by levels with the value decays' factors (levels_into); db's reverse
    row sums take the fp32 summands as bf16 pieces whatever the inputs' dtype
    (chunk_scan.sum_rows). fp16: the products with dh and A tf32 (common.op_dot)."""
    i_s, i_v, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_hk = i_h // (H // HK)
    KGATE: tl.constexpr = (G_MODE > 0) or USE_GK or (GAMMA_MODE > 0)
    i_n, bos, eos, p0 = slot_chunk(cu_seqlens, i_s, T, N, BT, IS_VARLEN, LOG_N)
    if p0 >= eos - bos:
        return
    gamma = head_gamma(g_gamma, i_n, i_h, H, GAMMA_MODE)
    o_t = tl.arange(0, BT)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_v = o_v < V
    p_dh = dh + (i_s * H + i_h).to(tl.int64) * K * V
    op = v.dtype.element_ty
    sop = tab.dtype.element_ty  # the scan table's 16-bit dtype
    rows_c, mask_c = block_rows(bos, eos, p0, BT, REVERSE)

    if not USE_GV:
        # A^T [s, t] read by transposed addresses (no transpose in registers)
        b_at = tl.load(A + (rows_c[None, :] * H + i_h) * BT + o_t[:, None], mask=mask_c[None, :],
                       other=0.)
        b_do = load_rows(do, rows_c, i_h, o_v, mask_c, mask_v, H, V)
        acc = op_dot(tl.where(o_t[:, None] <= o_t[None, :], b_at, 0.).to(wide_dtype(op)), b_do,
                     None, op, DOT_PREC)
        for i_k in range(0, tl.cdiv(K, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            mask_k = o_k < K
            b_k = load_rows(k, rows_c, i_hk, o_k, mask_c, mask_k, HK, K)
            if KGATE:
                b_k = to_chunk_end(b_k, decay_k(g, gk, gamma, rows_c, mask_c, i_h, o_k, mask_k,
                                                 H, K, BT, BK, G_MODE, USE_GK, GAMMA_MODE),
                                    g, gk, tab, BT, LEVELS, G_MODE, USE_GK, GAMMA_MODE)
            b_dh = tl.load(p_dh + o_k[:, None] * V + o_v[None, :],
                           mask=mask_k[:, None] & mask_v[None, :], other=0.)
            acc += op_dot(b_k, b_dh, None, b_k.dtype, DOT_PREC)
        tl.store(dv + (rows_c[:, None] * H + i_h) * V + o_v[None, :],
                 acc.to(dv.dtype.element_ty), mask=mask_c[:, None] & mask_v[None, :])
    else:  # value decays: dv's pairs by levels too, and the value-gate gradient db
        PV: tl.constexpr = decay_pieces(sop, gv.dtype.element_ty, True)
        b = decay_v(gv, rows_c, mask_c, i_h, o_v, mask_v, H, V, True, BT, BV)
        e_b = tl.exp2(tl.sum(b, 0) * LOG2E)  # the value decay over the whole chunk [BV]
        b0, b1, b2 = split_pieces(b, sop, PV)
        # through the chunk end's state gradient: (k gated) dh, decayed to the chunk end
        acc_s = tl.zeros([BT, BV], dtype=tl.float32)
        start = tl.zeros([BV], dtype=tl.float32)  # sum_K dh_end h_start exp(A_c), for db
        for i_k in range(0, tl.cdiv(K, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            mask_k = o_k < K
            m_kv = mask_k[:, None] & mask_v[None, :]
            b_k = load_rows(k, rows_c, i_hk, o_k, mask_c, mask_k, HK, K)
            b_dh = tl.load(p_dh + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.)
            b_hdh = tl.load(h + (i_s * H + i_h).to(tl.int64) * K * V + o_k[:, None] * V
                            + o_v[None, :], mask=m_kv, other=0.).to(tl.float32) * b_dh.to(
                                tl.float32)
            if KGATE:
                a = decay_k(g, gk, gamma, rows_c, mask_c, i_h, o_k, mask_k, H, K, BT, BK, G_MODE,
                            USE_GK, GAMMA_MODE)
                b_hdh *= tl.exp2(tl.sum(a, 0) * LOG2E)[:, None]
                b_k = to_chunk_end(b_k, a, g, gk, tab, BT, LEVELS, G_MODE, USE_GK, GAMMA_MODE)
            start += tl.sum(b_hdh, 0)
            acc_s += op_dot(b_k, b_dh, None, b_k.dtype, DOT_PREC)
        acc_s *= tl.exp2(scan(tab, LEVELS + 1, b0, b1, b2, BT, PV) * LOG2E)
        # inside the chunk: A^T (by transposed addresses) times do, by levels
        b_at = tl.load(A + (rows_c[None, :] * H + i_h) * BT + o_t[:, None], mask=mask_c[None, :],
                       other=0.)
        b_do = load_rows(do, rows_c, i_h, o_v, mask_c, mask_v, H, V)
        acc_i = levels_into(tl.zeros([BT, BV], dtype=tl.float32), b_at.to(wide_dtype(op)),
                            b_do, tab, b0, b1, b2, BT, LEVELS, PV, False, True, DOT_PREC)
        a_self = tl.load(A + (rows_c * H + i_h) * BT + o_t, mask=mask_c, other=0.)
        m_o = mask_c[:, None] & mask_v[None, :]
        tl.store(dv + (rows_c[:, None] * H + i_h) * V + o_v[None, :],
                 (acc_s + acc_i + a_self.to(tl.float32)[:, None] * b_do.to(tl.float32)).to(
                     dv.dtype.element_ty), mask=m_o)
        # db_r = sum_{t >= r} (o' do - v dv')_t + sum_K dh_end S_end, split as for da
        # in chunk_dqk_kernel (the chunk's own part of S_end cancels dv_state for t >= r)
        b_v = load_rows(v, rows_c, i_hk, o_v, mask_c, mask_v, HK, V).to(tl.float32)
        x = tl.load(odo + (rows_c[:, None] * H + i_h) * V + o_v[None, :], mask=m_o,
                    other=0.) - b_v * acc_i
        b_db = (sum_rows(tab, LEVELS, x, BT) + sum_rows(tab, LEVELS + 1, b_v * acc_s, BT)
                + (start * e_b)[None, :])
        if not USE_H0:  # as for da in chunk_dqk_kernel
            b_db = tl.where(((o_t == 0) & (p0 == 0))[:, None], 0., b_db)
        tl.store(db + (rows_c[:, None] * H + i_h) * V + o_v[None, :], b_db, mask=m_o)


@triton.jit
def chunk_dqk_kernel(
    q, k, v, g, gk, gv, g_gamma, h, dh, A, dA, tab, cu_seqlens, do,
    scale, T, N,
    dq, dk, da, dg_part, dgamma_part,
    H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    G_MODE: tl.constexpr, USE_GK: tl.constexpr, USE_GV: tl.constexpr, GAMMA_MODE: tl.constexpr,
    USE_H0: tl.constexpr, IS_VARLEN: tl.constexpr, REVERSE: tl.constexpr, LOG_N: tl.constexpr,
    LEVELS: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """dq [B,T,H,K], dk per query head [B,T,H,K], and the key-gate gradients
    for one chunk and K block: da [B,T,H,K] (g [B,T,H,K] / gk), its sum over the
    block per row dg_part [NK,B,T,H] (g [B,T,H]), per chunk dgamma_part [NK,slots,H].

    Through the states: dq = scale (do gated) h^T, dk = (v gated) dh^T, one
    [BT, BV] x [BV, BK] product each per V block, then row-scaled by the decay
    from the chunk start / to its end. Inside the chunk: dA = do v^T (with gv,
    the value-decayed dA of chunk_dA_kernel), split by the highest bit in which
    a pair's positions t > s differ: level l's pairs take the decay from s to t
    as F_l(t) F_l(s) (chunk_scan_table_kernel), so each level is one product
    (dA masked to the level) x (k F_l) for dq and (dA^T masked) x (q F_l) for
    dk, scaled by F_l on the rows it reaches: one exponential tile per level
    serves both.

    Gate gradients (notation of fused_recurrent.py): da_t = sum_{t' >= t in
    the chunk} (q dq' - k dk')_t' + carried, the primed gradients leaving out a
    step's own q.k term, and carried = everything after the chunk =
    sum_V dh_end S_end, with S_end = (h_start decayed over the chunk) + the
    chunk's own k v^T terms: exp(A_c) sum_V dh_end h_start exp(B_c) + sum_t k_t
    dk_state_t, from the same rounded products as dk' (so that the parts of
    dk' and carried that cancel are the same numbers). Their reverse row sums take the
    fp32 summands as bf16 pieces whatever the inputs' dtype (chunk_scan.sum_rows).

    dgamma is not summed from da: sum_t da_t adds (position + 1)-weighted terms
    whose difference is the (t - s)-weighted pair term, so fp32 error would grow
    with the chunk length. It is the derivative of the chunk's own decay factors
    instead: (t - s) A_ts dA_ts inside the chunk, (p + 1) q.dq and (n - 1 - p) k.dk
    through the states, n dh_end.(h decayed over the chunk): no cancelling terms. fp16:
    the products with h, dh and dA tf32 (common.op_dot)."""
    scale = tl.cast(scale, tl.float32)  # a float scalar may come as fp64 (common.py)
    i_s, i_k, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_hk = i_h // (H // HK)
    KGATE: tl.constexpr = (G_MODE > 0) or USE_GK or (GAMMA_MODE > 0)
    i_n, bos, eos, p0 = slot_chunk(cu_seqlens, i_s, T, N, BT, IS_VARLEN, LOG_N)
    if p0 >= eos - bos:
        return
    gamma = head_gamma(g_gamma, i_n, i_h, H, GAMMA_MODE)
    o_t = tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    mask_k = o_k < K
    rows, mask_t = block_rows(bos, eos, p0, BT, REVERSE)
    m_tk = mask_t[:, None] & mask_k[None, :]
    p_h = h + (i_s * H + i_h).to(tl.int64) * K * V
    p_dh = dh + (i_s * H + i_h).to(tl.int64) * K * V
    op = q.dtype.element_ty
    sop = tab.dtype.element_ty  # the scan table's 16-bit dtype
    b_q = load_rows(q, rows, i_h, o_k, mask_t, mask_k, H, K)
    b_k = load_rows(k, rows, i_hk, o_k, mask_t, mask_k, HK, K)

    # the key-side decays, split into pieces the table's dtype holds exactly
    ONE_GATE: tl.constexpr = ((((G_MODE == 2) & (not USE_GK)) | ((G_MODE == 0) & USE_GK)) & (
        GAMMA_MODE == 0)) | (not KGATE)
    gate = (g if G_MODE == 2 else gk) if ONE_GATE else q  # (q: never an absent pointer)
    PIECES: tl.constexpr = decay_pieces(sop, gate.dtype.element_ty, ONE_GATE)
    a = decay_k(g, gk, gamma, rows, mask_t, i_h, o_k, mask_k, H, K, BT, BK, G_MODE, USE_GK,
                GAMMA_MODE)
    e_c = tl.exp2(tl.sum(a, 0) * LOG2E)  # the decay over the whole chunk [BK]
    a0, a1, a2 = split_pieces(a, sop, PIECES)

    # dq through the chunk start's state: scale (do gated) h^T, decayed from the start
    b_dq = tl.zeros([BT, BK], dtype=tl.float32)
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        mask_v = o_v < V
        b_do = load_rows(do, rows, i_h, o_v, mask_t, mask_v, H, V)
        if USE_GV:
            b_do = (b_do.to(tl.float32) * tl.exp2(
                scan_v(gv, tab, rows, mask_t, i_h, o_v, mask_v, LEVELS, H, V, BT, BV)
                * LOG2E)).to(op)
        b_h = tl.load(p_h + o_k[:, None] * V + o_v[None, :],
                      mask=mask_k[:, None] & mask_v[None, :], other=0.)
        b_dq += op_dot(b_do, b_h, None, b_do.dtype, DOT_PREC, TRANS=True)
    if KGATE:
        b_dq *= tl.exp2(scan(tab, LEVELS, a0, a1, a2, BT, PIECES) * LOG2E)
    if GAMMA_MODE > 0:
        pos = o_t.to(tl.float32)[:, None]
        n_c = tl.minimum(eos - bos - p0, BT).to(tl.float32)
        dgamma = tl.sum(tl.sum((pos + 1.) * b_q.to(tl.float32) * b_dq, 1), 0) * scale

    # dq inside the chunk, level by level
    b_da = tl.load(dA + (rows[:, None] * H + i_h) * BT + o_t[None, :], mask=mask_t[:, None],
                   other=0.)
    if GAMMA_MODE > 0:
        if i_k == 0:  # the pairs inside the chunk (A sums over all of K)
            dist = tl.where(o_t[:, None] > o_t[None, :], (o_t[:, None] - o_t[None, :]), 0)
            b_a = tl.load(A + (rows[:, None] * H + i_h) * BT + o_t[None, :], mask=mask_t[:, None],
                          other=0.)
            dgamma += tl.sum(tl.sum(dist.to(tl.float32) * b_a.to(tl.float32) * b_da, 1), 0)
    # (the level masks keep only pairs s < t: no mask here; dA's scale goes on after)
    b_dq = levels_into(b_dq, b_da.to(wide_dtype(op)), b_k, tab, a0, a1, a2, BT, LEVELS, PIECES,
                       True, KGATE, DOT_PREC) * scale
    p_self = dA + (rows * H + i_h) * BT + o_t  # dA[t, t]: the step's own q.k term
    d_self = tl.load(p_self, mask=mask_t, other=0.) * scale
    # the step's own term, with k loaded again: no fp32 copy of k kept live
    b_self = d_self[:, None] * load_rows(k, rows, i_hk, o_k, mask_t, mask_k, HK, K).to(tl.float32)
    tl.store(dq + (rows[:, None] * H + i_h) * K + o_k[None, :],
             (b_dq + b_self).to(dq.dtype.element_ty), mask=m_tk)
    x = b_q.to(tl.float32) * b_dq

    # dk inside the chunk, from dA^T [s, t] loaded by transposed addresses (no
    # transpose in registers, no dA tile live through the dq store)
    b_dat = tl.load(dA + (rows[None, :] * H + i_h) * BT + o_t[:, None], mask=mask_t[None, :],
                    other=0.)
    b_dk = levels_into(tl.zeros([BT, BK], dtype=tl.float32), b_dat.to(wide_dtype(op)), b_q, tab,
                       a0, a1, a2, BT, LEVELS, PIECES, False, KGATE, DOT_PREC) * scale
    if KGATE:
        x -= b_k.to(tl.float32) * b_dk

    # dk through the chunk end's state gradient: (v gated) dh^T, decayed to the end
    b_dks = tl.zeros([BT, BK], dtype=tl.float32)
    start = tl.zeros([BK], dtype=tl.float32)  # sum_V dh_end h_start exp(B_c)
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        mask_v = o_v < V
        m_kv = mask_k[:, None] & mask_v[None, :]
        b_v = load_rows(v, rows, i_hk, o_v, mask_t, mask_v, HK, V)
        b_dh = tl.load(p_dh + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.)
        if KGATE:
            b_hdh = tl.load(p_h + o_k[:, None] * V + o_v[None, :], mask=m_kv,
                            other=0.).to(tl.float32) * b_dh.to(tl.float32)
        if USE_GV:
            b_v = (b_v.to(tl.float32) * tl.exp2(
                scan_v(gv, tab, rows, mask_t, i_h, o_v, mask_v, LEVELS + 1, H, V, BT, BV)
                * LOG2E)).to(op)
            if KGATE:
                b_hdh *= tl.exp2(tl.sum(decay_v(gv, rows, mask_t, i_h, o_v, mask_v, H, V, USE_GV,
                                               BT, BV), 0) * LOG2E)[None, :]
        if KGATE:
            start += tl.sum(b_hdh, 1)
        b_dks += op_dot(b_v, b_dh, None, b_v.dtype, DOT_PREC, TRANS=True)
    if KGATE:
        b_dks *= tl.exp2(scan(tab, LEVELS + 1, a0, a1, a2, BT, PIECES) * LOG2E)
        start *= e_c
    d_self = tl.load(p_self, mask=mask_t, other=0.) * scale
    b_self = d_self[:, None] * load_rows(q, rows, i_h, o_k, mask_t, mask_k, H, K).to(tl.float32)
    tl.store(dk + (rows[:, None] * H + i_h) * K + o_k[None, :],
             (b_dk + b_dks + b_self).to(dk.dtype.element_ty), mask=m_tk)
    y = b_k.to(tl.float32) * b_dks
    if GAMMA_MODE > 0:
        dgamma += tl.sum(tl.sum((n_c - 1. - pos) * y, 0) + n_c * start, 0)
        tl.store(dgamma_part + (i_k * tl.num_programs(0) + i_s) * H + i_h, dgamma)
    if KGATE:
        # da_r = sum_{t >= r} (q dq' - k dk')_t + sum_V dh_end S_end, where S_end
        # holds the chunk's own k v^T terms: their part sum_t k_t dk_state_t
        # cancels the state part of dk' for t >= r exactly, leaving t < r
        b_g = (sum_rows(tab, LEVELS, x, BT) + sum_rows(tab, LEVELS + 1, y, BT)
               + start[None, :])
        if not USE_H0:
            # a sequence's first decay acts on a zero state: its gradient is 0
            # exactly (the sum above would leave fp32 noise of cancelled terms)
            b_g = tl.where(((o_t == 0) & (p0 == 0))[:, None], 0., b_g)
        b_g = tl.where(m_tk, b_g, 0.)
        if (G_MODE == 2) or USE_GK:
            tl.store(da + (rows[:, None] * H + i_h) * K + o_k[None, :],
                     b_g.to(da.dtype.element_ty), mask=m_tk)
        if G_MODE == 1:
            n_rows = T if IS_VARLEN else N * T
            tl.store(dg_part + ((i_k * n_rows + rows) * H + i_h), tl.sum(b_g, 1), mask=mask_t)


@triton.jit
def chunk_dgamma_kernel(
    dgamma_part, cu_seqlens,
    T, NS,
    dgamma,
    H: tl.constexpr, BT: tl.constexpr, NK: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    """dgamma [N,H]: the per-chunk sums of one sequence added up, one program
    per (sequence, head)."""
    i_n, i_h = tl.program_id(0), tl.program_id(1)
    bos, eos = seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)
    slot0 = first_slot(cu_seqlens, i_n, T, BT, IS_VARLEN)
    acc = 0.
    for c in range(0, tl.cdiv(eos - bos, BT)):
        for i_k in range(0, NK):
            acc += tl.load(dgamma_part + (i_k * NS + slot0 + c) * H + i_h)
    tl.store(dgamma + i_n * H + i_h, acc)
