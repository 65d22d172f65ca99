"""Forward kernels of mode="chunk" (the GPU layout), also run by its backward.

Chunks of BT = 64 tokens in processing order, sub-chunks of BC = 16:
  chunk_state_kernel   sequential over chunks only, one program per (K block,
                       V block, sequence x head): the state at every chunk start
                       h [slots, H, K, V] and the final state (forward), or the
                       state gradient at every chunk end dh and d(initial_state)
                       (backward, BACKWARD=True);
  chunk_intra_kernel   parallel over (chunk x sub-chunk, head): the intra-chunk
                       matrix A [B, T, H, BT], A[t, s] = scale sum_k q_t k_s
                       exp(A_t - A_s) for s <= t (A_t the cumulative log decay);
  chunk_output_kernel  parallel over (chunk, V block, head):
                       o = scale (q gated) h + A v (gv: per sub-chunk pair).
Every tl.dot takes operands in the input dtype (bf16/fp16 -> tensor cores) with
fp32 accumulation; fp32 inputs use DOT_PREC ("ieee" unless tf32 was asked for).

Precision with strong gates: every exponential is of a sum of consecutive log
decays (never of a difference of two running sums, which cancels): within a
chunk, sum_{r <= t} a_r (a forward cumsum), sum_{r > s} a_r (a reverse cumsum of
the decays shifted one row, `next_rows`), and for a pair of sub-chunks j < i the
factor exp(A_t - A_s) = exp(L_t) exp(M_ij) exp(R_s): L_t from sub-chunk i's
start, M_ij the totals of the sub-chunks between, R_s to sub-chunk j's end. All
exponents are <= 0 for gates <= 0; only the diagonal 16 x 16 blocks difference
two sums, each of at most 16 steps (as the fused recurrence's precision allows).
"""

import triton
import triton.language as tl

from .common import (block_rows, decay_k, decay_k_between, decay_v, first_slot, head_gamma,
                     load_rows, next_rows, row_of, seq_bounds, slot_chunk)


@triton.jit
def chunk_state_kernel(
    x, y, g, gk, gv, g_gamma, s_in, cu_seqlens,
    scale, T,
    states, s_out,
    H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    G_MODE: tl.constexpr, USE_GK: tl.constexpr, USE_GV: tl.constexpr, GAMMA_MODE: tl.constexpr,
    USE_S_IN: tl.constexpr, STORE_OUT: tl.constexpr, IS_VARLEN: tl.constexpr,
    REVERSE: tl.constexpr, BACKWARD: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Forward (x=k, y=v, s_in=h0): states[slot c] = S at chunk c's start, s_out =
    final state. Backward (x=q, y=do, s_in=dht), chunks last to first:
    states[slot c] = dS at chunk c's end, s_out = d(initial_state). s_in and
    s_out are [N,H,K,V] fp32; states [slots,H,K,V] in its own dtype."""
    i_k, i_v, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_h = i_nh // H, i_nh % H
    i_hk = i_h // (H // HK)
    KGATE: tl.constexpr = (G_MODE > 0) or USE_GK or (GAMMA_MODE > 0)
    bos, eos = seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)
    slot0 = first_slot(cu_seqlens, i_n, T, BT, IS_VARLEN)
    o_k = i_k * BK + tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k, mask_v = o_k < K, o_v < V
    mask_h = mask_k[:, None] & mask_v[None, :]
    p_kv = o_k[:, None] * V + o_v[None, :]
    gamma = head_gamma(g_gamma, i_n, i_h, H, GAMMA_MODE)

    b_s = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_S_IN:
        b_s += tl.load(s_in + i_nh.to(tl.int64) * K * V + p_kv, mask=mask_h, other=0.)
    nt = tl.cdiv(eos - bos, BT)
    for it in range(0, nt):
        if BACKWARD:
            c = nt - 1 - it
        else:
            c = it
        tl.store(states + ((slot0 + c) * H + i_h) * K * V + p_kv,
                 b_s.to(states.dtype.element_ty), mask=mask_h)
        rows, mask_t = block_rows(bos, eos, c * BT, BT, REVERSE)
        if BACKWARD:
            b_x = load_rows(x, rows, i_h, o_k, mask_t, mask_k, H, K).to(tl.float32) * scale
            b_y = load_rows(y, rows, i_h, o_v, mask_t, mask_v, H, V).to(tl.float32)
        else:
            b_x = load_rows(x, rows, i_hk, o_k, mask_t, mask_k, HK, K).to(tl.float32)
            b_y = load_rows(y, rows, i_hk, o_v, mask_t, mask_v, HK, V).to(tl.float32)
        if KGATE:
            a = decay_k(g, gk, gamma, rows, mask_t, i_h, o_k, mask_k, H, K, BT, BK, G_MODE,
                        USE_GK, GAMMA_MODE)
            if BACKWARD:  # the outputs t of this chunk see its start through sum_{r <= t} a_r
                b_x *= tl.exp(tl.cumsum(a, 0))
            else:  # token s reaches the chunk end through sum_{r > s} a_r
                rn, mn = next_rows(bos, eos, c * BT, BT, REVERSE)
                an = decay_k(g, gk, gamma, rn, mn, i_h, o_k, mask_k, H, K, BT, BK, G_MODE,
                             USE_GK, GAMMA_MODE)
                b_x *= tl.exp(tl.cumsum(an, 0, reverse=True))
            b_s *= tl.exp(tl.sum(a, 0))[:, None]
        if USE_GV:
            b = decay_v(gv, rows, mask_t, i_h, o_v, mask_v, H, V, USE_GV, BT, BV)
            if BACKWARD:
                b_y *= tl.exp(tl.cumsum(b, 0))
            else:
                rn, mn = next_rows(bos, eos, c * BT, BT, REVERSE)
                bn = decay_v(gv, rn, mn, i_h, o_v, mask_v, H, V, USE_GV, BT, BV)
                b_y *= tl.exp(tl.cumsum(bn, 0, reverse=True))
            b_s *= tl.exp(tl.sum(b, 0))[None, :]
        op = x.dtype.element_ty
        b_s += tl.dot(tl.trans(b_x.to(op)), b_y.to(op), input_precision=DOT_PREC)
    if STORE_OUT:
        tl.store(s_out + i_nh.to(tl.int64) * K * V + p_kv, b_s, mask=mask_h)


@triton.jit
def chunk_intra_kernel(
    q, k, g, gk, g_gamma, cu_seqlens,
    scale, T, N,
    A,
    H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    G_MODE: tl.constexpr, USE_GK: tl.constexpr, GAMMA_MODE: tl.constexpr,
    IS_VARLEN: tl.constexpr, REVERSE: tl.constexpr, LOG_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Rows of sub-chunk i of A [B,T,H,BT] fp32 (columns are the chunk's
    positions; 0 above the diagonal). Off-diagonal 16x16 blocks by tl.dot,
    the diagonal block elementwise."""
    i_sc, i_h = tl.program_id(0), tl.program_id(1)
    NC: tl.constexpr = BT // BC
    i_s, i_i = i_sc // NC, i_sc % NC
    i_hk = i_h // (H // HK)
    i_n, bos, eos, p0 = slot_chunk(cu_seqlens, i_s, T, N, BT, IS_VARLEN, LOG_N)
    if p0 + i_i * BC >= eos - bos:
        return
    gamma = head_gamma(g_gamma, i_n, i_h, H, GAMMA_MODE)
    o_c = tl.arange(0, BC)
    rows_i, mask_i = block_rows(bos, eos, p0 + i_i * BC, BC, REVERSE)
    p_a = A + (rows_i[:, None] * H + i_h) * BT + o_c[None, :]
    op = q.dtype.element_ty

    for j in range(0, i_i):
        rows_j, mask_j = block_rows(bos, eos, p0 + j * BC, BC, REVERSE)
        rows_jn, mask_jn = next_rows(bos, eos, p0 + j * BC, BC, REVERSE)
        acc = tl.zeros([BC, BC], dtype=tl.float32)
        for i_k in range(0, tl.cdiv(K, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            mask_k = o_k < K
            b_q = load_rows(q, rows_i, i_h, o_k, mask_i, mask_k, H, K).to(tl.float32)
            b_k = load_rows(k, rows_j, i_hk, o_k, mask_j, mask_k, HK, K).to(tl.float32)
            l_i = tl.cumsum(decay_k(g, gk, gamma, rows_i, mask_i, i_h, o_k, mask_k, H, K, BC, BK,
                                    G_MODE, USE_GK, GAMMA_MODE), 0)
            r_j = tl.cumsum(decay_k(g, gk, gamma, rows_jn, mask_jn, i_h, o_k, mask_k, H, K, BC,
                                    BK, G_MODE, USE_GK, GAMMA_MODE), 0, reverse=True)
            m_ij = decay_k_between(g, gk, gamma, bos, eos, p0, j, i_i, i_h, o_k, mask_k, H, K, BT,
                                   BC, BK, G_MODE, USE_GK, GAMMA_MODE, REVERSE)
            b_qg = (b_q * tl.exp(l_i)).to(op)
            b_kg = (b_k * tl.exp(r_j + m_ij[None, :])).to(op)
            acc += tl.dot(b_qg, tl.trans(b_kg), input_precision=DOT_PREC)
        tl.store(p_a + j * BC, acc * scale, mask=mask_i[:, None])

    acc = tl.zeros([BC, BC], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        mask_k = o_k < K
        b_q = load_rows(q, rows_i, i_h, o_k, mask_i, mask_k, H, K).to(tl.float32)
        b_k = load_rows(k, rows_i, i_hk, o_k, mask_i, mask_k, HK, K).to(tl.float32)
        l_i = tl.cumsum(decay_k(g, gk, gamma, rows_i, mask_i, i_h, o_k, mask_k, H, K, BC, BK,
                                G_MODE, USE_GK, GAMMA_MODE), 0)
        for s in range(0, BC):
            causal = (o_c >= s)[:, None]
            k_s, l_s = row_of(b_k, o_c, s), row_of(l_i, o_c, s)
            d = tl.exp(tl.where(causal, l_i - l_s[None, :], 0.))
            col = tl.sum(tl.where(causal, b_q * k_s[None, :] * d, 0.), 1)
            acc += tl.where(o_c[None, :] == s, col[:, None], 0.)
    tl.store(p_a + i_i * BC, acc * scale, mask=mask_i[:, None])
    for j in range(i_i + 1, NC):
        tl.store(p_a + j * BC, tl.zeros([BC, BC], dtype=tl.float32), mask=mask_i[:, None])


@triton.jit
def chunk_output_kernel(
    q, v, g, gk, gv, g_gamma, A, h, cu_seqlens, do,
    scale, T, N,
    o,
    H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    G_MODE: tl.constexpr, USE_GK: tl.constexpr, USE_GV: tl.constexpr, GAMMA_MODE: tl.constexpr,
    IS_VARLEN: tl.constexpr, REVERSE: tl.constexpr, LOG_N: tl.constexpr,
    PRIME: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """o [B,T,H,V] (q's dtype) for one chunk and V block. PRIME (the backward's
    gv pass): o'_t * do_t in fp32 instead, o' leaving out the step's own token."""
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
    p_h = h + (i_s * H + i_h).to(tl.int64) * K * V
    rows_c, mask_c = block_rows(bos, eos, p0, BT, REVERSE)
    op = q.dtype.element_ty

    if not USE_GV:
        acc = tl.zeros([BT, BV], dtype=tl.float32)
        for i_k in range(0, tl.cdiv(K, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            mask_k = o_k < K
            b_q = load_rows(q, rows_c, i_h, o_k, mask_c, mask_k, H, K).to(tl.float32) * scale
            if KGATE:
                b_q *= tl.exp(tl.cumsum(decay_k(g, gk, gamma, rows_c, mask_c, i_h, o_k, mask_k, H,
                                                K, BT, BK, G_MODE, USE_GK, GAMMA_MODE), 0))
            b_h = tl.load(p_h + o_k[:, None] * V + o_v[None, :],
                          mask=mask_k[:, None] & mask_v[None, :], other=0.)
            acc += tl.dot(b_q.to(op), b_h.to(op), input_precision=DOT_PREC)
        b_a = tl.load(A + (rows_c[:, None] * H + i_h) * BT + o_t[None, :], mask=mask_c[:, None],
                      other=0.)
        b_a = tl.where(o_t[:, None] >= o_t[None, :], b_a, 0.)
        b_v = load_rows(v, rows_c, i_hk, o_v, mask_c, mask_v, HK, V)
        acc += tl.dot(b_a.to(op), b_v.to(op), input_precision=DOT_PREC)
        tl.store(o + (rows_c[:, None] * H + i_h) * V + o_v[None, :], acc.to(o.dtype.element_ty),
                 mask=mask_c[:, None] & mask_v[None, :])
    else:
        # value-side decays do not factor out of A: work per pair of sub-chunks
        NC: tl.constexpr = BT // BC
        o_c = tl.arange(0, BC)
        for i in tl.static_range(NC):
            rows_i, mask_i = block_rows(bos, eos, p0 + i * BC, BC, REVERSE)
            mask_pre = mask_c & (o_t < i * BC)
            acc = tl.zeros([BC, BV], dtype=tl.float32)
            for i_k in range(0, tl.cdiv(K, BK)):
                o_k = i_k * BK + tl.arange(0, BK)
                mask_k = o_k < K
                b_q = load_rows(q, rows_i, i_h, o_k, mask_i, mask_k, H, K).to(tl.float32) * scale
                if KGATE:  # sum_{r <= t} a_r over the chunk = earlier sub-chunks' totals + local
                    f_i = tl.cumsum(decay_k(g, gk, gamma, rows_i, mask_i, i_h, o_k, mask_k, H, K,
                                            BC, BK, G_MODE, USE_GK, GAMMA_MODE), 0)
                    f_i += tl.sum(decay_k(g, gk, gamma, rows_c, mask_pre, i_h, o_k, mask_k, H, K,
                                          BT, BK, G_MODE, USE_GK, GAMMA_MODE), 0)[None, :]
                    b_q *= tl.exp(f_i)
                b_h = tl.load(p_h + o_k[:, None] * V + o_v[None, :],
                              mask=mask_k[:, None] & mask_v[None, :], other=0.)
                acc += tl.dot(b_q.to(op), b_h.to(op), input_precision=DOT_PREC)
            lb_i = tl.cumsum(decay_v(gv, rows_i, mask_i, i_h, o_v, mask_v, H, V, USE_GV, BC, BV), 0)
            fb_pre = tl.sum(decay_v(gv, rows_c, mask_pre, i_h, o_v, mask_v, H, V, USE_GV, BT, BV),
                            0)
            acc *= tl.exp(lb_i + fb_pre[None, :])
            p_a = A + (rows_i[:, None] * H + i_h) * BT + o_c[None, :]
            mb = tl.zeros([BV], dtype=tl.float32)
            for j in tl.static_range(i - 1, -1, -1):
                rows_j, mask_j = block_rows(bos, eos, p0 + j * BC, BC, REVERSE)
                rows_jn, mask_jn = next_rows(bos, eos, p0 + j * BC, BC, REVERSE)
                rb_j = tl.cumsum(decay_v(gv, rows_jn, mask_jn, i_h, o_v, mask_v, H, V, USE_GV,
                                         BC, BV), 0, reverse=True)
                b_v = load_rows(v, rows_j, i_hk, o_v, mask_j, mask_v, HK, V).to(tl.float32)
                b_vg = b_v * tl.exp(rb_j + mb[None, :])
                b_a = tl.load(p_a + j * BC, mask=mask_i[:, None], other=0.)
                acc += tl.exp(lb_i) * tl.dot(b_a.to(op), b_vg.to(op), input_precision=DOT_PREC)
                mb += tl.sum(decay_v(gv, rows_j, mask_j, i_h, o_v, mask_v, H, V, USE_GV, BC, BV), 0)
            b_v = load_rows(v, rows_i, i_hk, o_v, mask_i, mask_v, HK, V).to(tl.float32)
            b_a = tl.load(p_a + i * BC, mask=mask_i[:, None], other=0.)
            for s in range(0, BC):
                if PRIME:
                    causal = (o_c > s)[:, None]
                else:
                    causal = (o_c >= s)[:, None]
                a_s = tl.sum(tl.where(o_c[None, :] == s, b_a, 0.), 1)
                v_s, lb_s = row_of(b_v, o_c, s), row_of(lb_i, o_c, s)
                d = tl.exp(tl.where(causal, lb_i - lb_s[None, :], 0.))
                acc += tl.where(causal, a_s[:, None] * v_s[None, :] * d, 0.)
            p_o = o + (rows_i[:, None] * H + i_h) * V + o_v[None, :]
            m_o = mask_i[:, None] & mask_v[None, :]
            if PRIME:
                b_do = load_rows(do, rows_i, i_h, o_v, mask_i, mask_v, H, V).to(tl.float32)
                tl.store(p_o, acc * b_do, mask=m_o)
            else:
                tl.store(p_o, acc.to(o.dtype.element_ty), mask=m_o)
