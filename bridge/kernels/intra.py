"""The intra-chunk matrix A of one chunk built on chip (fused_chunk.py's forward, and
fused_chunk_bwd.py's dv walk, which takes A^T): the levels of chunk_fwd.py's module
docstring from blocks of BKI keys, each block's q, k and decay tiles loaded once; with
decays the same for every key, q k^T times each pair's decay from one [BT, BT] sum. With
it the chunk's key decays and their factors (key_decays, key_gate, start_gate), which
the forward's state products take too."""

import triton
import triton.language as tl

from .common import (decay_k_in, exact_dtype, exp_, level_mask, load_tile, op_dtype,
                     pair_decays, seg_matrix, seg_sums, start_sums)


@triton.jit
def key_decays(DT: tl.constexpr, g, gk, gamma, row0, pos, mask_t, i_h, o_k, mask_k,
               H: tl.constexpr, K: tl.constexpr, G_MODE: tl.constexpr, USE_GK: tl.constexpr,
               GAMMA_MODE: tl.constexpr):
    """The chunk's key-side log decays a (common.decay_k_in) [BT, BK], or [BT, 16] when a
    is the same for every key (g [B,T,H] and g_gamma only): 16 columns instead of K."""
    if G_MODE == 2 or USE_GK:
        return decay_k_in(DT, g, gk, gamma, row0, pos, mask_t, i_h, o_k, mask_k, H, K, G_MODE,
                          USE_GK, GAMMA_MODE)
    else:
        o_u = tl.arange(0, 16)
        return decay_k_in(DT, g, gk, gamma, row0, pos, mask_t, i_h, o_u, o_u < 16, H, K,
                          G_MODE, USE_GK, GAMMA_MODE)


@triton.jit
def _per_key(f, total, PER_KEY: tl.constexpr):
    """Factors f [BT, BK] and the chunk's sums total [BK] as [BT, BK] and [BK, 1], or as
    [BT, 1] and a scalar when the decays are the same for every key (not PER_KEY)."""
    if PER_KEY:
        return f, total[:, None]
    else:
        return tl.max(f, 1)[:, None], tl.max(total, 0)


@triton.jit
def key_gate(c, DT: tl.constexpr, a, PER_KEY: tl.constexpr):
    """(exp(c @ a), the sum of a over the chunk) for key_decays' a (common.seg_sums),
    shaped by _per_key."""
    return _per_key(exp_(seg_sums(c, a, DT)), tl.sum(a.to(tl.float32), 0), PER_KEY)


@triton.jit
def start_gate(o_t, DT: tl.constexpr, a, PER_KEY: tl.constexpr):
    """(exp of the sums of a (key_decays) from the chunk's start to each row, inclusive;
    the chunk's sum), shaped by _per_key: key_gate's of level 2 BT but for the chunk's sum
    (common.start_sums)."""
    s, total = start_sums(o_t, a, DT)
    return _per_key(exp_(s), total, PER_KEY)


@triton.jit
def _a_level(acc, o_t, h, a, b_q, b_k, scale, DT: tl.constexpr, PER_KEY: tl.constexpr,
             op: tl.constexpr, DOT_PREC: tl.constexpr, REGION: tl.constexpr):
    """acc [BT, BT] plus A's pairs of level h from one block of keys: q, k [BT, BKI] and
    their log decays a (key_decays). REGION: the product in a branch of its own."""
    f, _ = key_gate(seg_matrix(o_t, h, DT), DT, a, PER_KEY)
    p = (tl.where(((o_t & h) != 0)[:, None], b_q, b_k).to(tl.float32) * f).to(op)
    if REGION:
        # (scale 0 makes A 0 either way) Triton gives two dots of one region that feed
        # each other (seg_sums' and this) a row-only warp layout, which at BT = 32 rows
        # repeats each product on num_warps / 2 warps
        if scale != 0:
            acc += tl.where(level_mask(o_t, h),
                            tl.dot(p, tl.trans(p), input_precision=DOT_PREC), 0.)
    else:
        acc += tl.where(level_mask(o_t, h), tl.dot(p, tl.trans(p), input_precision=DOT_PREC),
                        0.)
    return acc


@triton.jit
def _intra_block(acc, diag, q, k, g, gk, gamma, row0, pos, mask_t, i_h, i_hk, scale, kb,
                 H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, BKI: tl.constexpr,
                 G_MODE: tl.constexpr, USE_GK: tl.constexpr, GAMMA_MODE: tl.constexpr,
                 LEVELS: tl.constexpr, DOT_PREC: tl.constexpr, UNROLL: tl.constexpr,
                 PAIRS: tl.constexpr):
    """(acc, diag) plus the keys kb .. kb + BKI - 1 (`intra`): key decays by levels, but
    with PAIRS (or none) q k^T alone (`intra` decays it); UNROLL: the level loop
    unrolled into one straight body (the diagonal a product into acc, the levels without
    branches of their own: ptxas overlaps one level's products with the next one's
    gates, and Triton converts A to the next product's operand layout once, where in a
    branch a level it converts each level's product), else a runtime loop (one level's
    products live at a time, each in a branch of its own, the diagonal summed in diag)."""
    BT: tl.constexpr = pos.shape[0]
    o_t = tl.arange(0, BT)
    op: tl.constexpr = op_dtype(q.dtype.element_ty)
    KGATE: tl.constexpr = (G_MODE > 0) or USE_GK or (GAMMA_MODE > 0)
    PER_KEY: tl.constexpr = (G_MODE == 2) or USE_GK
    o_k = kb + tl.arange(0, BKI)
    mask_k = o_k < K
    b_q = load_tile(q, row0, pos, i_h, o_k, mask_t, mask_k, H, K)
    b_k = load_tile(k, row0, pos, i_hk, o_k, mask_t, mask_k, HK, K).to(b_q.dtype)
    if KGATE and not PAIRS:
        if UNROLL:
            acc += tl.where(o_t[:, None] == o_t[None, :],
                            tl.dot(b_q.to(op), tl.trans(b_k.to(op)), input_precision=DOT_PREC),
                            0.)
        else:
            diag += tl.sum(b_q.to(op).to(tl.float32) * b_k.to(op).to(tl.float32), 1)
        DT: tl.constexpr = exact_dtype(g.dtype.element_ty, gk.dtype.element_ty, G_MODE,
                                     USE_GK, GAMMA_MODE)
        a = key_decays(DT, g, gk, gamma, row0, pos, mask_t, i_h, o_k, mask_k, H, K,
                       G_MODE, USE_GK, GAMMA_MODE)
        if UNROLL:
            for lvl in tl.static_range(0, LEVELS):
                acc = _a_level(acc, o_t, (BT // 2) >> lvl, a, b_q, b_k, scale, DT, PER_KEY,
                               op, DOT_PREC, False)
        else:
            for lvl in range(0, LEVELS):
                acc = _a_level(acc, o_t, (BT // 2) >> lvl, a, b_q, b_k, scale, DT, PER_KEY,
                               op, DOT_PREC, True)
    else:
        acc = tl.dot(b_q.to(op), tl.trans(b_k.to(op)), acc, input_precision=DOT_PREC)
    return acc, diag


@triton.jit
def intra(q, k, g, gk, gamma, row0, pos, mask_t, i_h, i_hk, scale, k0, nki, H: tl.constexpr,
          HK: tl.constexpr, K: tl.constexpr, BKI: tl.constexpr, G_MODE: tl.constexpr,
          USE_GK: tl.constexpr, GAMMA_MODE: tl.constexpr, LEVELS: tl.constexpr,
          DOT_PREC: tl.constexpr, UNROLL: tl.constexpr, PAIRS: tl.constexpr):
    """A [BT, BT] fp32 of one chunk: scale sum_k q_tk k_sk exp(sum_{s<r<=t} a_rk) for
    s <= t, 0 above the diagonal, the sum over the keys k0 .. k0 + nki BKI - 1 (all of K,
    or the program's K block when K is split). Per-key decays' pairs by levels
    (chunk_intra_kernel's construction), all of them from each block of BKI keys while
    its q, k and decay tiles are loaded (once a chunk); the diagonal q_t . k_t ungated.
    PAIRS (decays the same for every key, g [B,T,H] or g_gamma, the kernel's SCALAR):
    q k^T times e^(common.pair_sums). UNROLL (all of K, k0 = 0): the key blocks and
    levels unrolled, for the pipeliner."""
    BT: tl.constexpr = pos.shape[0]
    o_t = tl.arange(0, BT)
    KGATE: tl.constexpr = (G_MODE > 0) or USE_GK or (GAMMA_MODE > 0)
    acc = tl.zeros([BT, BT], dtype=tl.float32)
    diag = tl.zeros([BT], dtype=tl.float32)
    if UNROLL:
        for i_k in tl.static_range(0, (K + BKI - 1) // BKI):
            acc, diag = _intra_block(acc, diag, q, k, g, gk, gamma, row0, pos, mask_t, i_h,
                                     i_hk, scale, i_k * BKI, H, HK, K, BKI, G_MODE, USE_GK,
                                     GAMMA_MODE, LEVELS, DOT_PREC, True, PAIRS)
    else:
        for i_k in range(0, nki):
            acc, diag = _intra_block(acc, diag, q, k, g, gk, gamma, row0, pos, mask_t, i_h,
                                     i_hk, scale, k0 + i_k * BKI, H, HK, K, BKI, G_MODE,
                                     USE_GK, GAMMA_MODE, LEVELS, DOT_PREC, False, PAIRS)
    if KGATE and not PAIRS:
        if not UNROLL:
            acc = tl.where(o_t[:, None] == o_t[None, :], diag[:, None], acc)
    else:
        if PAIRS:  # the same decay for every key: each pair's from one [BT, BT] sum
            DT: tl.constexpr = exact_dtype(g.dtype.element_ty, gk.dtype.element_ty, G_MODE,
                                           USE_GK, GAMMA_MODE)
            acc *= pair_decays(o_t, DT, g, gamma, row0, pos, mask_t, i_h, H, K, G_MODE,
                               GAMMA_MODE)
        acc = tl.where(o_t[:, None] >= o_t[None, :], acc, 0.)
    return acc * scale
