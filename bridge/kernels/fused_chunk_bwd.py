"""The on-chip backward of mode="fused_chunk": three walks over chunks of BT tokens (16;
32 for the dv walk on sm_90, `config`) with the state or its gradient in registers; no
per-chunk states in HBM.

Notation of fused_recurrent.py's module docstring (S~_t: the state before step t adds its
own token; the primed gradients leave out the step's own q.k term). Per chunk, with the
key decays from the chunk start to t (A_t) and from t + 1 to its end, and pairs s < t:

  fused_chunk_bwd_dq_kernel   the forward walk again, one program per (sequence x head,
      K block) with S [BK, V] fp32 in registers: dq'_t = scale e^(A_t) S_start do_t
      + scale sum_{s<t} (do_t.v_s) (decay s..t) k_s, [B,T,H,K] fp32; with dht and a key
      gate also sum_V dht S~_T [N,H,K] (the last token's k v left out of the last update).
  fused_chunk_bwd_dkv_kernel  the reverse walk, dS fp32 in registers from dht, chunks last
      to first, dS_start = e^(chunk) dS_end + scale (q gated from the start)^T do:
      DK, per K block (all of V): dk'_s = (dS_end v_s)(decay to the end)
          + scale sum_{t>s} (do_t.v_s) (decay s..t) q_t, and from it and dq' (FOLD,
          `_finish`) dq and dk with the steps' own terms and the key-gate gradients as
          fused_recurrent's reverse cumulative sum of q dq' - k dk' from the final-state
          term, inside a chunk one exact table product (common.seg_sums), across chunks a
          carried [BK] sum;
      DV, per V block (all of K): dv_s = (k_s gated to the end) dS_end + sum_{t>=s} A_ts do_t
          in v's dtype (fp32 per query head with GQA), A the forward's (its diagonal the
          step's own term): the block of the forward's kept A (fused_chunk.kept; A^T on
          sm_90, `kept_transposed`) that the chunk covers, else built again (intra.py),
          and d(initial_state).
  fused_chunk_bwd_combine_kernel  the same per (sequence x head) from dk' [B,T,H,K] fp32,
      where the DK walk does not (`config`'s fold: a head gate's or g_gamma's gradient, a
      sum over K, with K in several blocks).

Decays inside a chunk are common.seg_sums of the log decays (sums of consecutive decays,
exact fp32 sums of the decays' own values); dq' and dk' take the pairs s < t by levels
of their highest differing position bit (chunk_fwd.py), each level's decay F(t) F(s),
both exponents <= 0, but with decays the same for every key (g [B,T,H], g_gamma) each
pair's own from one [BT, BT] product (common.pair_sums: the decays over s < r <= t), no
levels; the F-scaled operand of dq' and dk' in two pieces of its 16-bit dtype
(common.split_dot; chunk_bwd.py: the two sides of a pair must round alike for the gate
gradient). The walks
split K (dq, dk) or V (dv) into blocks so that no gradient is a partial sum over blocks.

g_gamma's gradient dgamma [N,H] is the head gate's summed over the sequence's steps (the
same decay at every step and key), a sum over the whole walk whose terms cancel: there
the dq and dk walks take S and dh as dot operands, and the gated k and q that update
them, in two pieces (common.split_dot, split_dot_t), so that 16-bit roundings do not
shift it.

Not here (the chunk family's list runs instead, fused_chunk.backward_launches): the value
gate gv (its gradient needs o' do and value levels), g_gamma but alone in 16 bits, and
the shapes whose builds spill (`supported`).

Memory at (8,4096,16,128,128) bf16, g [B,T,H,K] (`parity.compiled --report`'s workspace, the
buffers beyond the returned gradients): dq' in fp32, 0.268 GB; the
chunk family's backward 0.948 GB (h, dh, kg, qg, dA), fused_chunk's fallback to it 1.015 GB.
"""

import os

import triton
import triton.language as tl

from .. import tuning
from ..contract import ITEMSIZE
from ..launch import Launch, Out
from . import chunk
from .intra import intra
from .common import (block_pos, decay_k_in, exact_dtype, exp_, flags, head_gamma, key_gated,
                     level_mask, load_tile, next_pow2, op_dtype, pair_decays, present,
                     seg_matrix, seg_sums, seq_bounds, op_dot, split_dot, split_dot_t,
                     start_sums, tile_ptrs, varlen_input, wide_dtype)


@triton.jit
def _factor(a, o_t, h, DT: tl.constexpr):
    """exp of the segmented sums of level h (common.seg_matrix) of the log decays a
    [BT, BK]: h = 2 BT from the chunk start to t, BT from t + 1 to the chunk end."""
    return exp_(seg_sums(seg_matrix(o_t, h, DT), a, DT))


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
def _program(cu_seqlens, g_gamma, T, H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr,
             V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NK: tl.constexpr,
             NV: tl.constexpr, IS_VARLEN: tl.constexpr, GAMMA_MODE: tl.constexpr):
    """This program's (sequence x head, K block, V block) on grid axis x: i_nh, its query
    and kv heads, the sequence's rows, its constant decay, the int64 base of its [K, V]
    state, the block's key and value columns, their masks and the int32 offsets of the
    [BK, BV] state tile."""
    pid = tl.program_id(0)
    i_nh, i_kv = pid // (NK * NV), pid % (NK * NV)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)
    o_k = (i_kv // NV) * BK + tl.arange(0, BK)
    o_v = (i_kv % NV) * BV + tl.arange(0, BV)
    return (i_nh, i_h, i_h // (H // HK), bos, eos, head_gamma(g_gamma, i_n, i_h, H, GAMMA_MODE),
            i_nh.to(tl.int64) * K * V, o_k, o_v, o_k < K, o_v < V,
            o_k[:, None] * V + o_v[None, :])


@triton.jit
def _state_in(x, base, p_kv, mask_k, mask_v, USE: tl.constexpr):
    """The [BK, BV] tile of a [N,H,K,V] state x in fp32 (zeros without USE)."""
    s = tl.zeros(p_kv.shape, dtype=tl.float32)
    if USE:
        s += tl.load(x + base + p_kv, mask=mask_k[:, None] & mask_v[None, :],
                     other=0.).to(tl.float32)
    return s


@triton.jit
def fused_chunk_bwd_dq_kernel(
    q, k, v, g, gk, g_gamma, h0, cu_seqlens, do, dht,
    scale, T,
    dq, dfa,
    H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NK: tl.constexpr,
    G_MODE: tl.constexpr, USE_GK: tl.constexpr, GAMMA_MODE: tl.constexpr,
    USE_H0: tl.constexpr, USE_DHT: tl.constexpr, IS_VARLEN: tl.constexpr,
    REVERSE: tl.constexpr, LEVELS: tl.constexpr, DOT_PREC: tl.constexpr, STAGES: tl.constexpr,
):
    """One (sequence x head, K block), all of V (BV >= V): dq' [B,T,H,K] fp32 and, with
    USE_DHT and g or gk, dfa [N,H,K] = sum_V dht S~_T (0 for an empty sequence).
    STAGES: the chunk loop's software pipelining (`config`)."""
    scale = tl.cast(scale, tl.float32)  # a float scalar may come as fp64 (common.py)
    i_nh, i_h, i_hk, bos, eos, gamma, base, o_k, o_v, mask_k, mask_v, p_kv = _program(
        cu_seqlens, g_gamma, T, H, HK, K, V, BK, BV, NK, 1, IS_VARLEN, GAMMA_MODE)
    KGATE: tl.constexpr = (G_MODE > 0) or USE_GK or (GAMMA_MODE > 0)
    PER_KEY: tl.constexpr = (G_MODE == 2) or USE_GK
    # pipelined with per-key decays, the chunk's sums are read off the product that gates
    # dq' (common.start_sums; else summed at the state's update, not held in between)
    START: tl.constexpr = STAGES > 1 and PER_KEY
    FINAL_A: tl.constexpr = USE_DHT and KGATE
    DT: tl.constexpr = exact_dtype(g.dtype.element_ty, gk.dtype.element_ty, G_MODE, USE_GK,
                                   GAMMA_MODE)
    op: tl.constexpr = op_dtype(q.dtype.element_ty)
    # g_gamma's gradient sums every step's, where a 16-bit rounding of S and of its gated k
    # would not cancel between dq' and dk': both in two pieces
    PRECISE: tl.constexpr = (GAMMA_MODE > 0) and (op != tl.float32)
    o_t = tl.arange(0, BT)
    b_s = _state_in(h0, base, p_kv, mask_k, mask_v, USE_H0)
    n = eos - bos
    for c in tl.range(0, tl.cdiv(n, BT), num_stages=STAGES):
        row0, pos, mask_t = block_pos(bos, eos, c * BT, BT, REVERSE)
        a = _key_decays(g, gk, gamma, row0, pos, mask_t, i_h, o_k, mask_k, H, K, G_MODE,
                        USE_GK, GAMMA_MODE)
        b_do = load_tile(do, row0, pos, i_h, o_v, mask_t, mask_v, H, V).to(op)
        b_v = load_tile(v, row0, pos, i_hk, o_v, mask_t, mask_v, HK, V).to(op)
        b_k = load_tile(k, row0, pos, i_hk, o_k, mask_t, mask_k, HK, K)
        if PRECISE:
            acc = split_dot(b_do, tl.trans(b_s), None, op, DOT_PREC, True)
        else:
            acc = op_dot(b_do, b_s, None, op, DOT_PREC, TRANS=True)
        if START:
            s_q, s_c = start_sums(o_t, a, DT)
            acc *= exp_(s_q)
        elif KGATE:
            acc *= _factor(a, o_t, 2 * BT, DT)
        d_a = tl.dot(b_do, tl.trans(b_v), input_precision=DOT_PREC)
        if KGATE and not PER_KEY:  # each pair's decay from one [BT, BT] sum, no levels
            e = pair_decays(o_t, DT, g, gamma, row0, pos, mask_t, i_h, H, K, G_MODE,
                            GAMMA_MODE)
            acc = op_dot(tl.where(o_t[:, None] > o_t[None, :], d_a * e, 0.).to(wide_dtype(op)),
                         b_k, acc, op, DOT_PREC)
        elif KGATE and STAGES > 1:  # the pipeliner takes no loop that holds a loop
            for lvl in tl.static_range(0, LEVELS):
                acc = _pairs_level(acc, a, o_t, (BT // 2) >> lvl, d_a, b_k, 1., True, op, DT,
                                   DOT_PREC)
        elif KGATE:
            for lvl in range(0, LEVELS):  # one level's tiles live at a time
                acc = _pairs_level(acc, a, o_t, (BT // 2) >> lvl, d_a, b_k, 1., True, op, DT,
                                   DOT_PREC)
        else:
            acc = split_dot(tl.where(o_t[:, None] > o_t[None, :], d_a, 0.).to(wide_dtype(op)),
                            b_k, acc, op, DOT_PREC)
        tl.store(tile_ptrs(dq, row0, pos, i_h, o_k, H, K), acc * scale,
                 mask=mask_t[:, None] & mask_k[None, :])
        if FINAL_A:  # S~_T: the last token's k v stays out of the last update
            b_k = tl.where((c * BT + o_t == n - 1)[:, None], 0., b_k)
        if KGATE:  # gated to the chunk's end
            b_k = b_k.to(tl.float32) * _factor(a, o_t, BT, DT)
            if not START:
                s_c = tl.sum(a.to(tl.float32), 0)
            b_s *= exp_(s_c)[:, None]
        b_s = split_dot_t(b_k, b_v, b_s, op, DOT_PREC, PRECISE)  # PRECISE: what k's lost
    if FINAL_A:
        b_dht = tl.load(dht + base + p_kv, mask=mask_k[:, None] & mask_v[None, :], other=0.)
        tl.store(dfa + i_nh * K + o_k, tl.where(n > 0, tl.sum(b_dht * b_s, 1), 0.),
                 mask=mask_k)


@triton.jit
def _pairs_level(acc, a, o_t, hl, d, x, scale, LATER: tl.constexpr, op: tl.constexpr,
                 DT: tl.constexpr, DOT_PREC: tl.constexpr):
    """acc [BT, BK] plus scale sum_s d[t, s] F(t) F(s) x_s over the pairs of level hl:
    s < t (LATER, dq': d = dA) or s > t (dk': d = dA^T, x = q); F the level's decays."""
    f = _factor(a, o_t, hl, DT)
    m = level_mask(o_t, hl) if LATER else _level_mask_t(o_t, hl)
    w = tl.where(m, d, 0.).to(wide_dtype(op))
    return acc + f * split_dot(w, x.to(tl.float32) * f, None, op, DOT_PREC) * scale


@triton.jit
def _level_mask_t(o_t, h):
    """level_mask transposed: [s, t] for the pairs t > s of level h."""
    x = o_t[:, None] ^ o_t[None, :]
    return (x >= h) & (x < 2 * h) & ((o_t & h) != 0)[None, :]


@triton.jit
def fused_chunk_bwd_dkv_kernel(
    q, k, v, g, gk, g_gamma, cu_seqlens, do, dht, dq_prime, dfa, a_kept,
    scale, T,
    dk, dv, dh0, dq, da, dg_head, dgamma,
    H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NK: tl.constexpr, NV: tl.constexpr,
    G_MODE: tl.constexpr, USE_GK: tl.constexpr, GAMMA_MODE: tl.constexpr,
    USE_H0: tl.constexpr, USE_DHT: tl.constexpr, IS_VARLEN: tl.constexpr,
    REVERSE: tl.constexpr, LEVELS: tl.constexpr, DOT_PREC: tl.constexpr,
    DK: tl.constexpr, DV: tl.constexpr, FOLD: tl.constexpr, STAGES: tl.constexpr,
    BTF: tl.constexpr, A_T: tl.constexpr,
):
    """One (sequence x head, K block, V block), chunks last to first, dS [BK, BV] fp32 in
    registers. DK (all of V, NV = 1): dk' [B,T,H,K] fp32; with FOLD instead the combine's
    work (`_finish`, from the dq walk's dq' and dfa): dq and dk per query head [B,T,H,K]
    and the gates' gradients (dg_head and dgamma only with all of K, NK = 1). DV (all of
    K, NK = 1):
    dv per query head [B,T,H,V] with the step's own term, and (USE_H0) dh0 [N,H,K,V]
    fp32; BTF > 0: A from a_kept [B,T,H,BTF], the forward's (its chunks of BTF tokens, a
    multiple of BT; A_T: stored as A^T), else (BTF = 0) built here."""
    scale = tl.cast(scale, tl.float32)  # a float scalar may come as fp64 (common.py)
    i_nh, i_h, i_hk, bos, eos, gamma, base, o_k, o_v, mask_k, mask_v, p_kv = _program(
        cu_seqlens, g_gamma, T, H, HK, K, V, BK, BV, NK, NV, IS_VARLEN, GAMMA_MODE)
    KGATE: tl.constexpr = (G_MODE > 0) or USE_GK or (GAMMA_MODE > 0)
    PER_KEY: tl.constexpr = (G_MODE == 2) or USE_GK
    KEPT: tl.constexpr = BTF > 0
    # pipelined, the chunk's sums are read off the product that gates q (common.start_sums;
    # with DV it spilled)
    START: tl.constexpr = STAGES > 1 and not DV
    # pipelined, the dv walk loads q, k and their decays again after A's own loads of them
    # (shared memory or L1 hits, as the forward's k): not live through A's products;
    # unpipelined, once, ahead of A (in flight through its products)
    LATE: tl.constexpr = STAGES > 1 and DV and not DK and not KEPT
    DT: tl.constexpr = exact_dtype(g.dtype.element_ty, gk.dtype.element_ty, G_MODE, USE_GK,
                                   GAMMA_MODE)
    op: tl.constexpr = op_dtype(q.dtype.element_ty)
    # as the dq walk's: dh and its gated q in two pieces for dk'
    PRECISE: tl.constexpr = (GAMMA_MODE > 0) and (op != tl.float32) and DK
    o_t = tl.arange(0, BT)
    b_dh = _state_in(dht, base, p_kv, mask_k, mask_v, USE_DHT)
    n = eos - bos
    nc = tl.cdiv(n, BT)
    carry = _carry_in(dfa, i_nh, o_k, mask_k, K, FOLD and USE_DHT and KGATE)
    gsum = 0.
    for i in tl.range(0, nc, num_stages=STAGES):
        row0, pos, mask_t = block_pos(bos, eos, (nc - 1 - i) * BT, BT, REVERSE)
        if not LATE:
            a = _key_decays(g, gk, gamma, row0, pos, mask_t, i_h, o_k, mask_k, H, K, G_MODE,
                            USE_GK, GAMMA_MODE)
            b_q = load_tile(q, row0, pos, i_h, o_k, mask_t, mask_k, H, K)
            b_k = load_tile(k, row0, pos, i_hk, o_k, mask_t, mask_k, HK, K)
        b_do = load_tile(do, row0, pos, i_h, o_v, mask_t, mask_v, H, V).to(op)
        if DK:
            b_v = load_tile(v, row0, pos, i_hk, o_v, mask_t, mask_v, HK, V).to(op)
        if FOLD and PER_KEY:  # in flight through the level loop (without it, loaded late:
            # one tile fewer live beside the products, which spilled in fp16 on sm_80)
            b_dq = load_tile(dq_prime, row0, pos, i_h, o_k, mask_t, mask_k, H, K)
        if DK:
            # through the chunk end's state gradient
            if PRECISE:
                acc_k = split_dot(b_v, tl.trans(b_dh), None, op, DOT_PREC, True)
            else:
                acc_k = op_dot(b_v, b_dh, None, op, DOT_PREC, TRANS=True)
            if KGATE:
                acc_k *= _factor(a, o_t, BT, DT)
            d_at = tl.dot(b_v, tl.trans(b_do), input_precision=DOT_PREC)  # dA^T [s, t]
            if KGATE and not PER_KEY:  # each pair's decay from one [BT, BT] sum, no levels
                later = o_t[:, None] < o_t[None, :]
                e_t = pair_decays(o_t, DT, g, gamma, row0, pos, mask_t, i_h, H, K, G_MODE,
                                  GAMMA_MODE, True)
                # scaled after the product, as dq' (the pair's two sides round alike)
                acc_k += op_dot(tl.where(later, d_at * e_t, 0.).to(wide_dtype(op)), b_q, None,
                                op, DOT_PREC) * scale
            elif KGATE and STAGES > 1:  # the pipeliner takes no loop that holds a loop
                for lvl in tl.static_range(0, LEVELS):
                    acc_k = _pairs_level(acc_k, a, o_t, (BT // 2) >> lvl, d_at, b_q, scale,
                                         False, op, DT, DOT_PREC)
            elif KGATE:
                for lvl in range(0, LEVELS):  # one level's tiles live at a time
                    acc_k = _pairs_level(acc_k, a, o_t, (BT // 2) >> lvl, d_at, b_q, scale,
                                         False, op, DT, DOT_PREC)
            else:
                acc_k += split_dot(tl.where(o_t[:, None] < o_t[None, :], d_at, 0.)
                                   .to(wide_dtype(op)), b_q, None, op, DOT_PREC) * scale
        if DV:
            # A^T do with the forward's A (its diagonal the step's own term), then the
            # chunk end's state gradient through k gated to the end
            if KEPT:  # this chunk's block of the forward's chunk (BTF a multiple of BT)
                b_at = load_tile(a_kept, row0, pos, i_h,
                                 tl.multiple_of((nc - 1 - i) * BT % BTF, BT) + o_t, mask_t,
                                 o_t < BT, H, BTF)
                if not A_T:
                    b_at = tl.trans(b_at)
            else:
                b_at = tl.trans(intra(q, k, g, gk, gamma, row0, pos, mask_t, i_h, i_hk, scale,
                                      0, 1, H, HK, K, BK, G_MODE, USE_GK, GAMMA_MODE, LEVELS,
                                      DOT_PREC, STAGES > 1, KGATE and not PER_KEY))
            acc_v = op_dot(b_at.to(wide_dtype(op)), b_do, None, op, DOT_PREC)
            if LATE:
                a = _key_decays(g, gk, gamma, row0, pos, mask_t, i_h, o_k, mask_k, H, K,
                                G_MODE, USE_GK, GAMMA_MODE)
                b_k = load_tile(k, row0, pos, i_hk, o_k, mask_t, mask_k, HK, K)
            if KGATE:
                acc_v = op_dot((b_k.to(tl.float32) * _factor(a, o_t, BT, DT)).to(op), b_dh,
                               acc_v, op, DOT_PREC)
            else:
                acc_v = op_dot(b_k.to(op), b_dh, acc_v, op, DOT_PREC)
        if FOLD:  # v_t . do_t: dA^T's diagonal
            vdo = tl.sum(tl.where(o_t[:, None] == o_t[None, :], d_at, 0.), 1) * scale
            if not PER_KEY:
                b_dq = load_tile(dq_prime, row0, pos, i_h, o_k, mask_t, mask_k, H, K)
            carry, gsum = _finish(b_q, b_k, b_dq, acc_k, vdo, carry, gsum,
                                  (nc - 1 - i) * BT + o_t, n, row0, pos, mask_t, i_h, o_k,
                                  mask_k, dq, dk, da, dg_head, H, K, G_MODE, USE_GK,
                                  GAMMA_MODE, USE_H0)
        elif DK:
            tl.store(tile_ptrs(dk, row0, pos, i_h, o_k, H, K), acc_k,
                     mask=mask_t[:, None] & mask_k[None, :])
        if DV:
            tl.store(tile_ptrs(dv, row0, pos, i_h, o_v, H, V), acc_v.to(dv.dtype.element_ty),
                     mask=mask_t[:, None] & mask_v[None, :])
        if LATE:
            b_q = load_tile(q, row0, pos, i_h, o_k, mask_t, mask_k, H, K)
        b_qs = b_q.to(tl.float32) * scale
        if KGATE:  # gated from the chunk's start
            if START:
                s_q, s_c = start_sums(o_t, a, DT)
                b_qs *= exp_(s_q)
            else:
                b_qs *= _factor(a, o_t, 2 * BT, DT)
                s_c = tl.sum(a.to(tl.float32), 0)
            b_dh *= exp_(s_c)[:, None]
        b_dh = split_dot_t(b_qs, b_do, b_dh, op, DOT_PREC, PRECISE)  # PRECISE: what q's lost
    if DV and USE_H0:
        tl.store(dh0 + base + p_kv, b_dh, mask=mask_k[:, None] & mask_v[None, :])
    if FOLD and GAMMA_MODE > 0:
        tl.store(dgamma + i_nh, gsum)


@triton.jit
def _carry_in(dfa, i_nh, o_k, mask_k, K: tl.constexpr, USE: tl.constexpr):
    """`_finish`'s carry before the last chunk [BK]: the final state's term dfa [N,H,K]
    (USE: with dht and a key gate), else 0."""
    carry = tl.zeros(o_k.shape, dtype=tl.float32)
    if USE:
        carry += tl.load(dfa + i_nh * K + o_k, mask=mask_k, other=0.)
    return carry


@triton.jit
def _finish(b_q, b_k, b_dq, b_dk, vdo, carry, gsum, p, n, row0, pos, mask_t, i_h, o_k, mask_k,
            dq, dk, da, dg_head, H: tl.constexpr, K: tl.constexpr, G_MODE: tl.constexpr,
            USE_GK: tl.constexpr, GAMMA_MODE: tl.constexpr, USE_H0: tl.constexpr):
    """One chunk's gradients from dq', dk' [BT, BK] fp32 (chunks last to first): dq and dk
    with the step's own terms (vdo [BT] = scale v_t . do_t), and for key gates da (g or
    gk [B,T,H,K]) or its sum over K dg_head (g [B,T,H]: BK holds all of K): the reverse
    cumulative sums of q dq' - k dk' (the sequence's last k dk' left out) from carry [BK],
    the later chunks' sums; inside the chunk one exact table product (common.seg_sums).
    Without USE_H0 the first step's gate gradient is exactly 0 (its gates decay a zero
    state). g_gamma's, the same sums over the chunk's steps and keys, added to gsum (BK
    holds all of K). p: the rows' positions in the sequence's processing order, n its
    length. Returns the carry for the chunk before and gsum."""
    b_q, b_k = b_q.to(tl.float32), b_k.to(tl.float32)
    m_tk = mask_t[:, None] & mask_k[None, :]
    tl.store(tile_ptrs(dq, row0, pos, i_h, o_k, H, K),
             (b_dq + vdo[:, None] * b_k).to(dq.dtype.element_ty), mask=m_tk)
    tl.store(tile_ptrs(dk, row0, pos, i_h, o_k, H, K),
             (b_dk + vdo[:, None] * b_q).to(dk.dtype.element_ty), mask=m_tk)
    if (G_MODE > 0) or USE_GK or (GAMMA_MODE > 0):
        BT: tl.constexpr = b_q.shape[0]
        x = b_q * b_dq - tl.where((p == n - 1)[:, None], 0., b_k * b_dk)
        b_g = carry[None, :] + x + seg_sums(seg_matrix(tl.arange(0, BT), BT, tl.float32), x,
                                            tl.float32)
        carry += tl.sum(x, 0)
        if not USE_H0:
            b_g = tl.where((p == 0)[:, None], 0., b_g)
        if (G_MODE == 2) or USE_GK:
            tl.store(tile_ptrs(da, row0, pos, i_h, o_k, H, K), b_g.to(da.dtype.element_ty),
                     mask=m_tk)
        if (G_MODE == 1) or (GAMMA_MODE > 0):
            g_t = tl.sum(tl.where(m_tk, b_g, 0.), 1)
            if G_MODE == 1:
                tl.store(dg_head + (row0 + pos) * H + i_h, g_t, mask=mask_t)
            if GAMMA_MODE > 0:
                gsum += tl.sum(g_t, 0)
    return carry, gsum


@triton.jit
def fused_chunk_bwd_combine_kernel(
    q, k, v, do, cu_seqlens, dq_prime, dk_prime, dfa,
    scale, T,
    dq, dk, da, dg_head, dgamma,
    H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    G_MODE: tl.constexpr, USE_GK: tl.constexpr, GAMMA_MODE: tl.constexpr, USE_H0: tl.constexpr,
    USE_DHT: tl.constexpr, IS_VARLEN: tl.constexpr, REVERSE: tl.constexpr,
):
    """One (sequence x head), all of K, chunks last to first: `_finish` from dq', dk'
    [B,T,H,K] fp32 and the final state's term dfa [N,H,K] (the dk walk does this itself
    where it can, `config`'s fold)."""
    scale = tl.cast(scale, tl.float32)  # a float scalar may come as fp64 (common.py)
    i_nh = tl.program_id(0)
    i_n, i_h = i_nh // H, i_nh % H
    i_hk = i_h // (H // HK)
    KGATE: tl.constexpr = (G_MODE > 0) or USE_GK or (GAMMA_MODE > 0)
    bos, eos = seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)
    n = eos - bos
    nc = tl.cdiv(n, BT)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = tl.arange(0, BV)
    mask_k, mask_v = o_k < K, o_v < V
    carry = _carry_in(dfa, i_nh, o_k, mask_k, K, USE_DHT and KGATE)
    gsum = 0.
    for i in range(0, nc):
        p = (nc - 1 - i) * BT + o_t  # processing positions of the chunk
        row0, pos, mask_t = block_pos(bos, eos, (nc - 1 - i) * BT, BT, REVERSE)
        b_q = load_tile(q, row0, pos, i_h, o_k, mask_t, mask_k, H, K)
        b_k = load_tile(k, row0, pos, i_hk, o_k, mask_t, mask_k, HK, K)
        vdo = tl.sum(load_tile(v, row0, pos, i_hk, o_v, mask_t, mask_v, HK, V).to(tl.float32)
                     * load_tile(do, row0, pos, i_h, o_v, mask_t, mask_v, H, V).to(tl.float32),
                     1) * scale
        b_dq = load_tile(dq_prime, row0, pos, i_h, o_k, mask_t, mask_k, H, K)
        b_dk = load_tile(dk_prime, row0, pos, i_h, o_k, mask_t, mask_k, H, K)
        carry, gsum = _finish(b_q, b_k, b_dq, b_dk, vdo, carry, gsum, p, n, row0, pos, mask_t,
                              i_h, o_k, mask_k, dq, dk, da, dg_head, H, K, G_MODE, USE_GK,
                              GAMMA_MODE, USE_H0)
    if GAMMA_MODE > 0:
        tl.store(dgamma + i_nh, gsum)


# ---------------------------------------------------------------- launch plan

BT = 16  # the walks' default chunk length (`config`; the forward takes 32)
# the combine's, at 8 warps: its loads of a chunk's six tiles are independent of the carry,
# so longer chunks shorten its serial chain (sequence length / chunk steps) to HBM time
COMBINE_BT = 32


def supported(plan) -> bool:
    """Whether these kernels take the plan: not opted out (GLA_BRIDGE_FUSED_CHUNK_BWD=chunk
    keeps the chunk family's list), no value gate gv (its gradient is not written here),
    and shapes whose builds have no register spills on sm_80 and sm_90 (`config`): K, V <=
    128 in 16 bits (<= 64 with both g and gk, whose decays the dv walk splits into 3
    pieces), <= 64 in fp32 (FMA products); g_gamma (decays in 3 pieces, its gradient's
    state products in 2) alone, in 16 bits at K, V <= 128 (`config`: fp16's dq and dk
    walks past 64 at 8 warps on sm_90, both on 32-key blocks elsewhere)."""
    if os.environ.get("GLA_BRIDGE_FUSED_CHUNK_BWD", "onchip") == "chunk":
        return False
    if plan.gv:
        return False
    if plan.g_gamma != "none":
        return (plan.g == "none" and not plan.gk
                and plan.dtype in ("bfloat16", "float16") and max(plan.K, plan.V) <= 128)
    wide = plan.dtype in ("bfloat16", "float16") and not (plan.g != "none" and plan.gk)
    return max(plan.K, plan.V) <= (128 if wide else 64)


# The walks' launch sites (fused_chunk.SITES: the device table may set their warps and
# chunk lengths), with the candidates the GPU kit's sweep tries
SITES = {"bwd_dq": dict(num_warps=(4, 8), BT=(16, 32), stages=(2, 3)),
         "bwd_dk": dict(num_warps=(4, 8), BT=(16, 32), stages=(2, 3)),
         "bwd_dv": dict(num_warps=(4, 8), SV=(32, 64, 128), BT=(16, 32),
                        with_dk=(False, True), stages=(2, 3))}


def config(plan, a_chunk: int = 0) -> dict:
    """BK, BV: K and V padded to powers of 2; SK: the K blocks of the dq and dk walks (all
    of V), 64 for 16-bit inputs, 16 for fp32, but 32 on sm_80's tiles (mma.sync: operands
    in registers) with g_gamma (its states in 2 pieces beside its decays in 3: on 64 the
    walks spilled 268-1124 B at K = 64, in the loop), beside V under 128 (pipelined on 64
    per-key decays spilled 248-1416 B at K = 50..128, a folding head gate 8 B at K = 50;
    without gates the model has 32 faster) and with per-key decays over 64 keys at most
    (faster in the model); SV: the V blocks of the dv walk (all of K), 32 (64 spilled on
    sm_80), 16 for fp32 (FMA products); warps: 4 in 16 bits (two programs a SM without
    spills; A's [16, 16] products repeat on fewer warps than at 8), 8 in fp32 (4
    spilled); chunks: each walk's chunk length, BT; on sm_90 (tuning.wgmma), 16 bits:
    the dv walk on all of V at 8 warps on 32-token chunks (A built once a head instead of
    once a V block, half the serial steps; spilled on sm_80), 16 for fp16 with key decays
    past 64 keys (its tf32 state and A products: 32 spilled 112-372 B in its loop); the
    dq and dk walks on 32-token chunks spilled at 4 warps on sm_90, in fp16 and under
    triton 3.6, and ran two waves at 8; with_dk: the dv walk also writes dk' where it has
    all of V (one reverse walk instead of two; off by default: at K = V = 128 it spilled
    without gates under triton 3.6 and in fp16, a sweep candidate); each walk's the
    device table's entry where it has one (`SITES`); fold: the walk that makes dk'
    finishes dq, dk and the gate's gradient itself (no combine pass: dk' never goes to
    HBM, q, k, v, do are not read again) but where a head gate's or g_gamma's gradient
    would be a sum over its K blocks; stages: each walk's software pipelining (3: the
    tiles of the chunk after next loaded during this one, the level loops unrolled, since
    the pipeliner takes no loop that holds a loop; at 2 the next chunk's loads issue at
    the end of the body, so each run starts waiting on them; at 1 each chunk's loads wait
    on the shared memory its previous products used), 3 in 16 bits (sm_80's cp.async as
    sm_90's wgmma tiles) but where it spilled: fp16's dk walk with per-key decays past 96
    keys (8 B at K = 128), and on sm_80's tiles fp16's dk walk with them on V = 32 (32
    B), the dv walk with them past 64 keys (1.0-1.9 KB) or with both g and gk (56-224 B
    at K = 50, 64) where it builds A's levels itself (a_chunk: the forward's A loaded
    instead, fused_chunk.kept) and the dq walk with both on V = 32 (12-36 B); 1 in
    fp32; with the forward's A (a_chunk, its chunk length) the dv walk on the forward's
    chunks in 16 bits (on sm_80's tiles 32 where 16 was the default, halving its serial
    steps) but with both g and gk on sm_80's tiles (32 spilled 24-296 B there); fp16 with
    g_gamma past 64 keys or values: the dq and dk walks at 8 warps on sm_90 (at 4 their
    states in tf32 pieces spilled 256-312 B); off sm_90 in 16 bits the dk walk that
    folds a head gate's gradient (all of K in one block) at 8 warps (at 4 it spilled
    92-188 B at K = 50)."""
    BK, BV = max(16, next_pow2(plan.K)), max(16, next_pow2(plan.V))
    wide = plan.dtype in ("bfloat16", "float16")
    warps = 4 if wide else 8
    # sm_90: the dv walk on all of V (A's levels built once a head) at 8 warps, on 32-token
    # chunks (half the serial steps)
    whole = wide and tuning.wgmma()
    sync = wide and not whole  # sm_80's mma.sync: operands in registers
    # fp16 on sm_90: the dv walk on 16-token chunks with key decays past 64 keys
    fp16 = whole and plan.dtype == "float16"
    keyed = plan.g == "key" or plan.gk  # per-key decays (fused_chunk.config's name)
    both = plan.g != "none" and plan.gk  # decays in 3 pieces (`supported`)
    # mma.sync: the dq and dk walks on 32-key blocks with g_gamma, beside V under 128 and
    # with per-key decays over 64 keys at most
    narrow = sync and (plan.g_gamma != "none" or BV < 128 or keyed and BK <= 64)
    SK = min(32 if narrow else 64 if wide else 16, BK)
    stages = dict(bwd_dq=3 if wide and not (sync and both and BV <= 32) else 1,
                  bwd_dk=3 if wide and not (plan.dtype == "float16" and keyed and (
                      plan.K > 96 or sync and BV <= 32)) else 1,
                  bwd_dv=3 if wide and not (sync and keyed and (BK > 64 or both)
                                            and not a_chunk) else 1)
    gamma16 = fp16 and plan.g_gamma != "none" and max(plan.K, plan.V) > 64
    # off sm_90, 16 bits: the dk walk that folds a head gate's gradient (all of K in one
    # block) at 8 warps (at 4 it spilled 92-188 B at K = V = 50)
    head8 = sync and plan.g == "head" and SK >= plan.K
    dv16 = fp16 and key_gated(plan) and BK > 64
    knobs = {site: tuning.pick(plan, "fused_chunk", site,
                               dict(num_warps=8 if gamma16 or (head8 and site == "bwd_dk")
                                    else warps, BT=BT, stages=stages[site]))
             for site in ("bwd_dq", "bwd_dk")}
    knobs["bwd_dv"] = tuning.pick(plan, "fused_chunk", "bwd_dv",
                                  dict(num_warps=8 if whole else warps,
                                       SV=BV if whole else 32 if wide else 16,
                                       BT=(a_chunk if a_chunk and wide and not (sync and both)
                                           else 32 if whole and not dv16 else BT),
                                       with_dk=False,
                                       stages=stages["bwd_dv"]))
    SV = min(knobs["bwd_dv"]["SV"], BV)
    summed = plan.g == "head" or plan.g_gamma != "none"  # gradients summed over K
    with_dk = bool(knobs["bwd_dv"]["with_dk"]) and SV >= BV
    return dict(BK=BK, BV=BV, SK=SK, SV=SV,
                warps={site: k["num_warps"] for site, k in knobs.items()},
                chunks={site: k["BT"] for site, k in knobs.items()},
                with_dk=with_dk, fold=not summed or with_dk or SK >= plan.K,
                stages={site: k["stages"] for site, k in knobs.items()})


def kept_a(plan, bt: int) -> Out:
    """The forward's A [B,T,H,bt] as the dv walk's A^T do takes it (common.wide_dtype): in
    q's dtype for bf16 (2 bytes a token, head and chunk position: bt/K times q's size),
    fp32 for fp16 (its tf32 products) and fp32; transposed where `kept_transposed`."""
    return Out("A", (plan.B, plan.T, plan.H, bt),
               "like:q" if plan.dtype == "bfloat16" else "float32")


def kept_transposed() -> bool:
    """Whether the kept A is stored as A^T (row s, column t's place in the chunk): on
    sm_90's tiles (tuning.wgmma), where the forward that stores A^T builds without spills
    at K = V = 32..128 but 100 and the one that stores A spilled 12-24 B; on sm_80's
    tiles storing A^T spilled 60 B at K = V = 128, A none."""
    return tuning.wgmma()


def launches(plan, use_dht: bool, a_chunk: int = 0) -> list:
    """Reads the forward inputs, do [B,T,H,V], (use_dht) dfinal_state [N,H,K,V] and with
    a_chunk the forward's A [B,T,H,a_chunk] (`kept_a`: its chunk length, a multiple of
    the dv walk's); writes dq' [B,T,H,K] and dfa [N,H,K] (fp32; dk' too
    without `config`'s fold) on the way and the buffers bridge.grads reads (module
    docstring). `supported(plan)` must hold."""
    c = config(plan, a_chunk)
    B, T, H, K, V, N = plan.B, plan.T, plan.H, plan.K, plan.V, plan.N
    nk, nv = -(-K // c["SK"]), -(-V // c["SV"])
    fl = flags(plan)
    consts = dict(H=fl["H"], HK=fl["HK"], K=K, V=V, G_MODE=fl["G_MODE"],
                  USE_GK=fl["USE_GK"], GAMMA_MODE=fl["GAMMA_MODE"], USE_H0=plan.initial_state,
                  USE_DHT=use_dht, IS_VARLEN=plan.varlen, REVERSE=plan.reverse,
                  DOT_PREC=chunk.dot_precision())
    # each walk's chunk length BT and its levels, log2 BT
    walk = {site: dict(consts, BT=bt, LEVELS=bt.bit_length() - 1)
            for site, bt in c["chunks"].items()}
    gates = present(plan, "g", "gk", "g_gamma")
    cu = varlen_input(plan)
    dht = "dfinal_state" if use_dht else None
    final_a = use_dht and key_gated(plan)
    own = plan.group == 1
    isz = ITEMSIZE[plan.dtype]
    tokens = B * T
    keyed = plan.g == "key" or plan.gk  # per-key decays: A's levels (else one pair product)

    def dot_flops(site):
        """Per chunk and head (x 2 bt for FLOPs): the state products (2 [bt,K]x[K,V] and the
        update), and dA and its level products (2 pieces each) or A's levels and A^T do."""
        bt = c["chunks"][site]
        chunks = T // bt + N if plan.varlen else B * -(-T // bt)
        levels = bt.bit_length() - 1 if keyed else 1
        inner = (bt * V + levels * 2 * bt * K if site != "bwd_dv"
                 else bt * V if a_chunk else levels * bt * (K + V))
        return int(2 * bt * chunks * H * (2 * K * V + inner))

    f32 = tokens * H * K * 4
    qkvdo = tokens * (H * K + plan.Hk * (K + V) + H * V) * isz
    merged, fold = c["with_dk"], c["fold"]
    # the gradients the combine writes (`_finish`), in whichever kernel does it
    finals = dict(dq=Out("dq", (B, T, H, K), "like:q"),
                  dk=Out("dk_h", (B, T, H, K), "like:k" if own else "float32"),
                  da=Out("da", (B, T, H, K), "like:g" if plan.g == "key" else "like:gk")
                  if plan.g == "key" or plan.gk else None,
                  dg_head=Out("dg_head", (B, T, H)) if plan.g == "head" else None,
                  dgamma=Out("dgamma", (N, H)) if plan.g_gamma != "none" else None)
    finals_bytes = tokens * H * (K * (2 * isz if own else isz + 4)
                                 + (K * isz if plan.g == "key" or plan.gk else 0)
                                 + (4 if plan.g == "head" else 0))
    # the walk that makes dk': its outputs, extra inputs and bytes beyond q, k, v, do, g
    if fold:
        dk_walk = dict(outputs=dict(finals), inputs=dict(dq_prime="dq_prime",
                                                         dfa="dfa" if final_a else None),
                       bytes=f32 + finals_bytes)
    else:
        dk_walk = dict(outputs=dict(dk=Out("dk_prime", (B, T, H, K))),
                       inputs=dict.fromkeys(("dq_prime", "dfa")), bytes=f32)
    no_dk = dict.fromkeys(("dk", "dq", "da", "dg_head", "dgamma"))  # the dv walk without dk'
    no_dk_in = dict.fromkeys(dk_walk["inputs"])
    return [
        Launch(fused_chunk_bwd_dq_kernel, grid=(nk * N * H,),
               inputs=dict(q="q", k="k", v="v", **gates,
                           h0="initial_state" if plan.initial_state else None, **cu, do="do",
                           dht=dht),
               scalars=dict(scale=plan.scale, T=T),
               outputs=dict(dq=Out("dq_prime", (B, T, H, K)),
                            dfa=Out("dfa", (N, H, K)) if final_a else None),
               constexprs=dict(walk["bwd_dq"], BK=c["SK"], BV=c["BV"], NK=nk,
                               STAGES=c["stages"]["bwd_dq"]),
               num_warps=c["warps"]["bwd_dq"], dot_flops=dot_flops("bwd_dq"),
               bytes=int(qkvdo + f32)),
        *([] if merged else [Launch(
            fused_chunk_bwd_dkv_kernel, grid=(nk * N * H,),
            inputs=dict(q="q", k="k", v="v", **gates, **cu, do="do", dht=dht,
                        **dk_walk["inputs"], a_kept=None),
            scalars=dict(scale=plan.scale, T=T),
            outputs=dict(no_dk, **dk_walk["outputs"], dv=None, dh0=None),
            constexprs=dict(walk["bwd_dk"], BK=c["SK"], BV=c["BV"], NK=nk, NV=1, DK=True,
                            DV=False, FOLD=fold, STAGES=c["stages"]["bwd_dk"], BTF=0,
                            A_T=False),
            num_warps=c["warps"]["bwd_dk"], dot_flops=dot_flops("bwd_dk"),
            bytes=int(qkvdo + tokens * H * K * isz + dk_walk["bytes"]))]),
        # the dv walk (with_dk: and dk', all of K and V in one program)
        Launch(fused_chunk_bwd_dkv_kernel, grid=(nv * N * H,),
               inputs=dict(q="q", k="k", v="v", **gates, **cu, do="do", dht=dht,
                           **(dk_walk["inputs"] if merged else no_dk_in),
                           a_kept="A" if a_chunk else None),
               scalars=dict(scale=plan.scale, T=T),
               outputs=dict(no_dk, **(dk_walk["outputs"] if merged else {}),
                            dv=Out("dv_h", (B, T, H, V), "like:v" if own else "float32"),
                            dh0=Out("d_initial_state", (N, H, K, V))
                            if plan.initial_state else None),
               constexprs=dict(walk["bwd_dv"], BK=c["BK"], BV=c["SV"], NK=1, NV=nv, DK=merged,
                               DV=True, FOLD=fold and merged,
                               STAGES=c["stages"]["bwd_dv"], BTF=a_chunk,
                               A_T=a_chunk > 0 and kept_transposed()),
               num_warps=c["warps"]["bwd_dv"],
               dot_flops=dot_flops("bwd_dv") + (dot_flops("bwd_dk") if merged else 0),
               bytes=int(qkvdo + tokens * H * K * isz + tokens * H * V * (isz if own else 4)
                         + (dk_walk["bytes"] if merged else 0)
                         + (nv * kept_a(plan, a_chunk).nbytes(plan) if a_chunk else 0))),
        *([] if fold else [Launch(
            fused_chunk_bwd_combine_kernel, grid=(N * H,),
            inputs=dict(q="q", k="k", v="v", do="do", **cu, dq_prime="dq_prime",
                        dk_prime="dk_prime", dfa="dfa" if final_a else None),
            scalars=dict(scale=plan.scale, T=T),
            outputs=finals,
            constexprs=dict(H=fl["H"], HK=fl["HK"], K=K, V=V, BT=COMBINE_BT, BK=c["BK"],
                            BV=c["BV"], G_MODE=fl["G_MODE"], USE_GK=fl["USE_GK"],
                            GAMMA_MODE=fl["GAMMA_MODE"], USE_H0=plan.initial_state,
                            USE_DHT=use_dht,
                            IS_VARLEN=plan.varlen, REVERSE=plan.reverse),
            num_warps=8, bytes=int(qkvdo + 2 * f32 + finals_bytes))]),
    ]
