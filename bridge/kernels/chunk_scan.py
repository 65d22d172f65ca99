"""The scan table of the chunked backward (chunk_bwd.py) and the products on it.

Decays by 0/1 matrices: every sum of consecutive log decays a kernel needs (from
the chunk start, to the chunk end, within the blocks of a level) is one product
of a table matrix with the [BT, D] decay tile on tensor cores, the tile in one
piece of the table's 16-bit dtype when it is one gate of that dtype, else in
three (exact to fp32); exponentials are exp2 of log2(e)-scaled sums. The pairs
s < t inside a chunk split into LEVELS = log2(BT) levels by the highest bit in
which t and s differ; a level's decay factors into F_l(t) F_l(s), both
exponentials of sums of consecutive decays (<= 0: no overflow, no differences
of running sums), so each level is one [BT, BT] x [BT, D] product with dA
masked to its pairs (levels_into): no per-row loops, no cross-warp reductions,
one exponential tile serving dq and dk.
"""

import triton
import triton.language as tl

from .common import LOG2E, decay_v, op_dot, split_dot, split_pieces


@triton.jit
def scan_matrix(i, BT: tl.constexpr, LEVELS: tl.constexpr, dtype: tl.constexpr):
    """Matrix i [BT, BT] of the scan table (0/1 in `dtype`); chunk_dA_kernel
    writes all 2 LEVELS + 3 of them. The pairs s < t of a chunk split into
    levels by the highest bit l in which t and s differ (t has it set, s not).
    Matrix l < LEVELS: times a [BT, D] tile of per-step log decays, the sums F_l
    exponentiates: row t sums over t's aligned block of 2^l positions, from its
    start to t where bit l of t is set, else from t + 1 to its end; so for a
    pair of level l, F_l(t) F_l(s) is the decay from s to t, a product of two
    exponentials of sums of consecutive decays, both <= 0. Matrix LEVELS: from
    the chunk start to t; LEVELS + 1: from t + 1 to the chunk end. Matrix
    LEVELS + 2 + l: the pairs (t, s) of level l; 2 LEVELS + 2: all pairs s < t."""
    t = tl.arange(0, BT)[:, None]
    r = tl.arange(0, BT)[None, :]
    lw = tl.where(i < LEVELS, i, i - LEVELS - 2)
    upper = ((t >> lw) & 1) == 1
    m = ((t >> lw) == (r >> lw)) & tl.where(upper, r <= t, r > t)
    m = tl.where(i == LEVELS, r <= t, m)
    m = tl.where(i == LEVELS + 1, r > t, m)
    m = tl.where(i >= LEVELS + 2, (((t ^ r) >> lw) == 1) & (t > r), m)
    m = tl.where(i == 2 * LEVELS + 2, t > r, m)
    return tl.where(m, 1., 0.).to(dtype)


@triton.constexpr_function
def decay_pieces(op, gate, one_gate):
    """How many tiles of the table's 16-bit dtype `op` hold a tile of log
    decays (or other fp32 values) exactly for a tensor-core product with a 0/1
    matrix: 1 when they are one gate of that dtype, else 3 (24 bits, as fp32)."""
    return 1 if one_gate and gate == op else 3


@triton.jit
def scan(tab, idx, a0, a1, a2, BT: tl.constexpr, PIECES: tl.constexpr, m=None):
    """Table matrix `idx` (or the given m) times a0 + a1 + a2 [BT, D] (the
    first PIECES of them, see decay_pieces), fp32 [BT, D]."""
    o_t = tl.arange(0, BT)
    if m is None:
        m = tl.load(tab + idx * BT * BT + o_t[:, None] * BT + o_t[None, :])
    s = tl.dot(m, a0)
    if PIECES > 1:
        s += tl.dot(m, a1)
        s += tl.dot(m, a2)
    return s


@triton.jit
def sum_rows(tab, idx, x, BT: tl.constexpr):
    """(table matrix idx)^T x for an fp32 [BT, D] x: matrix LEVELS gives the
    sums over rows r >= t, LEVELS + 1 over r < t. x goes in as three bf16
    pieces, exact to fp32 over fp32's range, whatever the table's dtype: the
    summands of a gate gradient pass 65,504 where fp16 outputs overflow, and fp16
    pieces of them were inf (inf - inf in the split, then NaN in every row)."""
    o_t = tl.arange(0, BT)
    m = tl.load(tab + idx * BT * BT + o_t[None, :] * BT + o_t[:, None]).to(tl.bfloat16)
    x0, x1, x2 = split_pieces(x, tl.bfloat16, 3)
    return scan(tab, idx, x0, x1, x2, BT, 3, m)


@triton.jit
def levels_into(acc, b_a, b_x, tab, a0, a1, a2, BT: tl.constexpr, LEVELS: tl.constexpr,
                 PIECES: tl.constexpr, LATER: tl.constexpr, KGATE: tl.constexpr,
                 DOT_PREC: tl.constexpr):
    """acc [BT, D] plus the pairs inside the chunk, level by level: row t of
    acc gets sum_s b_a[t, s] b_x[s] times the decay between s and t, b_a [BT, BT]
    dA (LATER: acc's rows are its rows, for dq) or dA^T (for dk), in common.wide_dtype
    of b_x's dtype; only the pairs s < t count. With F the level's factor
    (chunk_scan_table_kernel), each level is one product, (b_a masked to the
    level's pairs) x (b_x F), scaled by F; the masked b_a picks the right rows
    of both. A runtime loop, so that one level's tiles are live at a time."""
    o_t = tl.arange(0, BT)
    # without decays one product over all pairs, but for fp32 (FMA products,
    # whose operands ptxas then spills) the level loop's masked products
    ONE: tl.constexpr = (not KGATE) & (b_x.dtype != tl.float32) & (b_x.dtype != tl.float64)
    for lw in range(0, 1 if ONE else LEVELS):
        if not ONE:
            f = tl.exp2(scan(tab, lw, a0, a1, a2, BT, PIECES) * LOG2E)
            p_pair = tab + (LEVELS + 2 + lw) * BT * BT
        else:  # no decays: one product over all pairs
            f = tl.full([BT, 1], 1., tl.float32)
            p_pair = tab + (2 * LEVELS + 2) * BT * BT
        if LATER:
            pair = tl.load(p_pair + o_t[:, None] * BT + o_t[None, :])
        else:  # by transposed addresses, in the layout of b_a's transposed load
            pair = tl.load(p_pair + o_t[None, :] * BT + o_t[:, None])
        b_w = (b_a.to(tl.float32) * pair.to(tl.float32)).to(b_a.dtype)
        # b_x F in two pieces of its dtype (common.split_dot): rounded to one,
        # the dq and dk sides of a pair round differently and the gate gradient,
        # where the two cancel, loses the difference (5x on dg, see SPEC.md)
        y = f * b_x.to(tl.float32)
        if ONE:
            p = op_dot(b_w, y.to(b_x.dtype), None, b_x.dtype, DOT_PREC)
        else:
            p = split_dot(b_w, y, None, b_x.dtype, DOT_PREC)
        acc += f * p
    return acc


@triton.jit
def to_chunk_end(b_k, a, g, gk, tab, BT: tl.constexpr, LEVELS: tl.constexpr,
                  G_MODE: tl.constexpr, USE_GK: tl.constexpr, GAMMA_MODE: tl.constexpr):
    """Keys b_k [BT, BK] decayed to the chunk end by the key decays a [BT, BK]
    (token s by sum_{r > s} a_r), in b_k's dtype."""
    sop = tab.dtype.element_ty
    ONE: tl.constexpr = (((G_MODE == 2) & (not USE_GK)) | ((G_MODE == 0) & USE_GK)) & (
        GAMMA_MODE == 0)
    gate = (g if G_MODE == 2 else gk) if ONE else tab  # (tab: never an absent pointer)
    PIECES: tl.constexpr = decay_pieces(sop, gate.dtype.element_ty, ONE)
    a0, a1, a2 = split_pieces(a, sop, PIECES)
    return (b_k.to(tl.float32) * tl.exp2(scan(tab, LEVELS + 1, a0, a1, a2, BT, PIECES)
                                         * LOG2E)).to(b_k.dtype)


@triton.jit
def scan_v(gv, tab, rows, mask_t, i_h, o_v, mask_v, idx, H: tl.constexpr, V: tl.constexpr,
            BT: tl.constexpr, BV: tl.constexpr):
    """scan of the value-side decays gv over one V block."""
    b = decay_v(gv, rows, mask_t, i_h, o_v, mask_v, H, V, True, BT, BV)
    sop = tab.dtype.element_ty
    PV: tl.constexpr = decay_pieces(sop, gv.dtype.element_ty, True)
    b0, b1, b2 = split_pieces(b, sop, PV)
    return scan(tab, idx, b0, b1, b2, BT, PV)
