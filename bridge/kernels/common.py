"""`@triton.jit` helpers and launch-plan pieces shared by both kernel families
(fused_recurrent.py and chunk.py): sequence bounds, the constant decay, the
flags and gate inputs of a Plan. Nothing here is private to one family."""

import triton
import triton.language as tl

from ..decay import RESET_FLOOR
from ..dispatch import refusal


@triton.jit
def seq_bounds(cu_seqlens, i_n, T, IS_VARLEN: tl.constexpr):
    """First and one-past-last token row of sequence i_n (int64)."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
    return bos, eos


@triton.jit
def head_gamma(g_gamma, i_n, i_h, H: tl.constexpr, GAMMA_MODE: tl.constexpr):
    """The constant log decay of this (sequence, head): [H] or [N, H] form, 0 if absent."""
    gamma = 0.0
    if GAMMA_MODE == 1:
        gamma = floored(tl.load(g_gamma + i_h).to(tl.float32))
    if GAMMA_MODE == 2:
        gamma = floored(tl.load(g_gamma + i_n * H + i_h).to(tl.float32))
    return gamma


def next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def check_k(plan, mode: str) -> None:
    """A ValueError naming q or v when family `mode` refuses the plan's head dims: the
    limits are bridge.dispatch.HEAD_DIMS (K, V <= 512 for chunk and fused_recurrent, which
    block both over loops and programs; K, V <= 512 for fused_chunk), so that
    dispatch's "auto" never picks a family that refuses the call."""
    why = refusal(plan, mode)
    if why is not None:
        raise ValueError(why)


def flags(plan) -> dict:
    """The constexpr switches of a Plan that every kernel of both families takes."""
    return dict(H=plan.H, HK=plan.Hk, K=plan.K, V=plan.V,
                G_MODE={"none": 0, "head": 1, "key": 2}[plan.g], USE_GK=plan.gk,
                USE_GV=plan.gv, GAMMA_MODE={"none": 0, "head": 1, "seq": 2}[plan.g_gamma],
                IS_VARLEN=plan.varlen, REVERSE=plan.reverse)


def present(plan, *names) -> dict:
    """{name: name} for the given inputs of `names`, {name: None} for the absent ones: the
    inputs of a Launch whose kernel parameters are named like the tensors."""
    given = plan.inputs()
    return {n: n if n in given else None for n in names}


def gate_inputs(plan) -> dict:
    """The gates g, gk, gv, g_gamma as Launch inputs (kernel parameters of those names)."""
    return present(plan, "g", "gk", "gv", "g_gamma")


def varlen_input(plan) -> dict:
    """cu_seqlens as a Launch input: None (unread) without it."""
    return {"cu_seqlens": "cu_seqlens" if plan.varlen else None}


def key_gated(plan) -> bool:
    """Whether any decay acts along K (g, gk or g_gamma)."""
    return plan.g != "none" or plan.gk or plan.g_gamma != "none"


# ------------------------------------------------------------ chunk layout helpers
# The chunked kernels cut every sequence into chunks of BT tokens in processing
# order (backwards with `reverse`). Per-chunk buffers (states h / dh) live in
# "slots": sequence n's chunks take consecutive slots from first_slot(n). Without
# cu_seqlens that is n * ceil(T / BT); with it, floor(bos_n / BT) + n, which never
# overlaps the next sequence's and stays below floor(total / BT) + N: a static
# bound, so the slot of every chunk is known on the device with no host table.


@triton.jit
def first_slot(cu_seqlens, i_n, T, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """The first chunk slot of sequence i_n (int64)."""
    if IS_VARLEN:
        return tl.load(cu_seqlens + i_n).to(tl.int64) // BT + i_n
    else:
        return i_n.to(tl.int64) * tl.cdiv(T, BT)


@triton.jit
def slot_chunk(cu_seqlens, i_s, T, N, BT: tl.constexpr, IS_VARLEN: tl.constexpr,
               LOG_N: tl.constexpr):
    """(i_n, bos, eos, p0) of the chunk in slot i_s: its sequence, the sequence's
    token rows and the chunk's first processing position. p0 >= eos - bos marks an
    unused slot. With
    cu_seqlens the owner is the last sequence whose first slot is <= i_s (a binary
    search of LOG_N steps over cu_seqlens)."""
    if IS_VARLEN:
        lo = i_s * 0
        hi = lo + N - 1
        for _ in range(LOG_N):
            mid = (lo + hi + 1) // 2
            ok = tl.load(cu_seqlens + mid).to(tl.int64) // BT + mid <= i_s
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid - 1)
        bos = tl.load(cu_seqlens + lo).to(tl.int64)
        eos = tl.load(cu_seqlens + lo + 1).to(tl.int64)
        p0 = (i_s - (bos // BT + lo)) * BT
        i_n = lo
    else:
        nt = tl.cdiv(T, BT)
        i_n = i_s // nt
        bos = i_n.to(tl.int64) * T
        eos = bos + T
        p0 = (i_s % nt).to(tl.int64) * BT
    return i_n, bos, eos, p0


@triton.jit
def block_rows(bos, eos, p0, BT: tl.constexpr, REVERSE: tl.constexpr):
    """Token rows [BT] of processing positions p0..p0+BT-1 and their mask
    (masked rows point at bos, so every address stays in bounds)."""
    p = p0 + tl.arange(0, BT)
    mask = p < (eos - bos)
    if REVERSE:
        rows = eos - 1 - p
    else:
        rows = bos + p
    return tl.where(mask, rows, bos), mask


@triton.jit
def next_rows(bos, eos, p0, BT: tl.constexpr, REVERSE: tl.constexpr):
    """block_rows shifted one position on, masked to the block: decays loaded on
    these rows and reverse-summed give sum_{r > s} a_r directly (no difference of
    two sums, so no cancellation with strong gates)."""
    rows, mask = block_rows(bos, eos, p0 + 1, BT, REVERSE)
    return rows, mask & (tl.arange(0, BT) < BT - 1)


@triton.jit
def load_rows(x, rows, i_h, o_d, mask_t, mask_d, HX: tl.constexpr, D: tl.constexpr):
    """x[rows, i_h, o_d] of a [*, HX, D] tensor as [BT, BD] in x's dtype, zeros where masked."""
    ptr = x + (rows[:, None] * HX + i_h) * D + o_d[None, :]
    return tl.load(ptr, mask=mask_t[:, None] & mask_d[None, :], other=0.)


@triton.jit
def block_pos(bos, eos, p0, BT: tl.constexpr, REVERSE: tl.constexpr):
    """(row0, pos, mask) of processing positions p0..p0+BT-1: the token row of p0
    (int64), each position's row offset from it [BT] (0 where masked, so every
    address stays in bounds) and the mask. Tiles are then a scalar base plus
    small offsets (load_tile), which keeps few address registers live."""
    o = tl.arange(0, BT)
    mask = o < (eos - bos - p0)
    if REVERSE:
        return eos - 1 - p0, tl.where(mask, -o, 0), mask
    else:
        return bos + p0, tl.where(mask, o, 0), mask


@triton.jit
def tile_ptrs(x, row0, pos, i_h, o_d, HX: tl.constexpr, D: tl.constexpr):
    """Pointers [BT, BD] to x[row0 + pos, i_h, o_d] of a [*, HX, D] tensor."""
    BT: tl.constexpr = pos.shape[0]
    if BT * HX * D < 2 ** 31:
        off = pos * (HX * D)
    else:
        off = pos.to(tl.int64) * (HX * D)
    return x + (row0 * HX + i_h) * D + off[:, None] + o_d[None, :]


@triton.jit
def load_tile(x, row0, pos, i_h, o_d, mask_t, mask_d, HX: tl.constexpr, D: tl.constexpr):
    """x[row0 + pos, i_h, o_d] as [BT, BD] in x's dtype, zeros where masked."""
    return tl.load(tile_ptrs(x, row0, pos, i_h, o_d, HX, D),
                   mask=mask_t[:, None] & mask_d[None, :], other=0.)


@triton.jit
def decay_k(g, gk, gamma, rows, mask_t, i_h, o_k, mask_k, H: tl.constexpr, K: tl.constexpr,
            BT: tl.constexpr, BK: tl.constexpr, G_MODE: tl.constexpr, USE_GK: tl.constexpr,
            GAMMA_MODE: tl.constexpr):
    """Per-step log decays along K, a = g + gk + gamma, fp32 [BT, BK]; 0 on masked rows."""
    a = tl.zeros([BT, BK], dtype=tl.float32)
    if G_MODE == 1:
        a += tl.load(g + rows * H + i_h, mask=mask_t, other=0.).to(tl.float32)[:, None]
    if G_MODE == 2:
        a += load_rows(g, rows, i_h, o_k, mask_t, mask_k, H, K).to(tl.float32)
    if USE_GK:
        a += load_rows(gk, rows, i_h, o_k, mask_t, mask_k, H, K).to(tl.float32)
    if GAMMA_MODE > 0:
        a += tl.where(mask_t, gamma, 0.)[:, None]
    return floored(a)


@triton.jit
def decay_k_between(g, gk, gamma, bos, eos, p0, j, i, i_h, o_k, mask_k, H: tl.constexpr,
                    K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                    G_MODE: tl.constexpr, USE_GK: tl.constexpr, GAMMA_MODE: tl.constexpr,
                    REVERSE: tl.constexpr):
    """Total key-side log decay over the sub-chunks strictly between j < i of the
    chunk at p0, fp32 [BK] (0 when they are adjacent): a same-sign sum."""
    rows_c, mask_c = block_rows(bos, eos, p0, BT, REVERSE)
    o_t = tl.arange(0, BT)
    m = mask_c & (o_t >= (j + 1) * BC) & (o_t < i * BC)
    return tl.sum(decay_k(g, gk, gamma, rows_c, m, i_h, o_k, mask_k, H, K, BT, BK, G_MODE, USE_GK,
                          GAMMA_MODE), 0)


@triton.jit
def decay_v(gv, rows, mask_t, i_h, o_v, mask_v, H: tl.constexpr, V: tl.constexpr,
            USE_GV: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr):
    """Per-step log decays along V (gv), fp32 [BT, BV]; 0 when absent or masked."""
    if USE_GV:
        return floored(load_rows(gv, rows, i_h, o_v, mask_t, mask_v, H, V).to(tl.float32))
    else:
        return tl.zeros([BT, BV], dtype=tl.float32)


@triton.jit
def row_of(x, o_t, j):
    """Row j of a [BT, D] register tile as [D] (exact: the other rows add 0)."""
    return tl.sum(tl.where((o_t == j)[:, None], x, 0.), axis=0)


# ------------------------------------------------------------ segmented decay sums
# Exponents inside a chunk are sums of consecutive log decays (never differences
# of running sums). They are computed as products c @ a with 0/1 matrices c, so
# tensor cores do the scans: exact sums when a's values are exact dot operands.

LOG2E = tl.constexpr(1.4426950408889634)
FLOOR = tl.constexpr(RESET_FLOOR)


@triton.jit
def floored(a):
    """Log decays a (any float dtype) with those below -RESET_FLOOR raised to it: resets
    (bridge.decay), -inf among them; NaN stays NaN."""
    return tl.where(a < -FLOOR, -FLOOR, a).to(a.dtype)


@triton.jit
def exp_(x):
    """e^x as one MUFU.EX2 (tl.exp adds denormal handling around it)."""
    return tl.math.exp2(x * LOG2E)


# Compile-time values (dtypes, counts, switches derived from constexprs) are written one
# way in every kernel: an inline constexpr expression bound as `NAME: tl.constexpr = ...`,
# or a call of a `triton.constexpr_function` on constexprs (element dtypes such as
# `x.dtype.element_ty`, ints, bools). A `@triton.jit` helper returns tensors only: one that
# returns a dtype compiles on some Triton versions and not on others.
# Float scalar arguments (`scale`) are pinned to fp32 on a kernel's first line: Inductor
# types a user kernel's Python floats fp64 (under torch.compile on CUDA), and an fp64
# scalar turns the fp32 tiles it touches into fp64 (a loop-carried tile then fails to
# compile, the others run in fp64).

@triton.constexpr_function
def op_dtype(dt):
    """The dtype of tl.dot operands made from values of element dtype dt: its own, but
    float32 for float64 (computed in fp32, per the SPEC)."""
    return tl.float32 if dt == tl.float64 else dt


@triton.constexpr_function
def wide_dtype(op):
    """The dtype in which a computed fp32 tile (a pair product q.k or do.v, a state) enters
    op_dot with operands op: op, but float32 for float16 (op_dot rounds it there)."""
    return tl.float32 if op == tl.float16 else op


@triton.jit
def op_dot(x, y, acc, OP: tl.constexpr, DOT_PREC: tl.constexpr, TRANS: tl.constexpr = False):
    """acc + x @ y (x @ y^T with TRANS), fp32 [M, N], for x [M, D] and y [D, N] each an
    input tile (dtype OP) or a computed tile (fp32, or wide_dtype(OP)): both as OP, but for
    fp16 OP both in fp32 at tf32, an fp32 one rounded to nearest at tf32's 10 mantissa
    bits: fp16's precision with fp32's range (a state, a pair product, or their gradients
    pass fp16's 65,504 where the outputs do not; as fp16 operands they would be inf).
    acc: fp32 [M, N] or None."""
    if OP == tl.float16:
        xx = _tf32_near(x)
        yy = _tf32_near(y)
        if TRANS:
            yy = tl.trans(yy)
        return tl.dot(xx, yy, acc, input_precision="tf32")
    else:
        xx = x.to(OP)
        yy = y.to(OP)
        if TRANS:
            yy = tl.trans(yy)
        return tl.dot(xx, yy, acc, input_precision=DOT_PREC)


@triton.jit
def split_dot(w, y, acc, OP: tl.constexpr, DOT_PREC: tl.constexpr, WIDE: tl.constexpr = False):
    """acc + w @ y (op_dot) for a y [D, N] computed in fp32 (or loaded in another dtype):
    y in two pieces of the 16-bit dtype OP, y's rounding to OP and what that rounding lost
    (16 bits of mantissa: both sides of a pair round alike for the gate gradient,
    chunk_bwd.py), one piece for fp32 and fp64 OP or a y in OP; WIDE (a y past fp16's
    range, a state): for fp16 OP the pieces at tf32, fp16's precision with fp32's range, as
    op_dot takes them. acc: fp32 [M, N] or None."""
    if y.dtype == OP:  # exact in OP: what a rounding to OP loses is 0
        return op_dot(w, y, acc, OP, DOT_PREC)
    if WIDE and (OP == tl.float16):
        y0 = _tf32_near(y)
        p = op_dot(w, y - y0, acc, OP, DOT_PREC)
        return op_dot(w, y0, p, OP, DOT_PREC)
    y0 = y.to(OP)
    if (OP == tl.float32) | (OP == tl.float64):
        return op_dot(w, y0, acc, OP, DOT_PREC)
    p = op_dot(w, (y - y0.to(tl.float32)).to(OP), acc, OP, DOT_PREC)
    return op_dot(w, y0, p, OP, DOT_PREC)


@triton.jit
def split_dot_t(x, y, acc, OP: tl.constexpr, DOT_PREC: tl.constexpr, SPLIT: tl.constexpr):
    """acc + x^T @ y, fp32 [D, N], for x [M, D] (fp32, or any float dtype) and y [M, N] in
    the operand dtype OP: x rounded to OP, and with SPLIT also what that rounding lost
    (split_dot's two pieces, the split operand on the left), both as OP operands (for
    fp16 only an x within its range: a key or query gated by decays <= 1). acc: fp32."""
    x0 = x.to(OP)
    if SPLIT:
        acc = tl.dot(tl.trans((x.to(tl.float32) - x0.to(tl.float32)).to(OP)), y, acc,
                     input_precision=DOT_PREC)
    return tl.dot(tl.trans(x0), y, acc, input_precision=DOT_PREC)


@triton.jit
def _tf32_near(x):
    """x as fp32: exact for a 16-bit x, else rounded half away from zero to 10 mantissa
    bits (as cvt.rna.tf32), so that the tensor cores, which read a tf32 operand's top 19
    bits, do not truncate."""
    if x.dtype == tl.float16:
        return x.to(tl.float32)
    else:
        bits = (x.to(tl.float32).to(tl.uint32, bitcast=True) + 0x1000) & 0xFFFFE000
        return bits.to(tl.float32, bitcast=True)


@triton.constexpr_function
def exact_dtype(g_dt, gk_dt, G_MODE, USE_GK, GAMMA_MODE):
    """The 16-bit dtype in which every key-side decay a = g + gk + gamma is exact (one
    16-bit gate source, no constant decay), else float32 (a is split). g_dt, gk_dt: the
    element dtypes of g's and gk's pointers (an absent one's is its stand-in's)."""
    dt = g_dt if G_MODE > 0 else gk_dt
    one = ((G_MODE > 0) != bool(USE_GK)) and GAMMA_MODE == 0
    return dt if one and dt in (tl.bfloat16, tl.float16) else tl.float32


@triton.jit
def decay_k_in(DT: tl.constexpr, g, gk, gamma, row0, pos, mask_t, i_h, o_k, mask_k,
               H: tl.constexpr, K: tl.constexpr, G_MODE: tl.constexpr, USE_GK: tl.constexpr,
               GAMMA_MODE: tl.constexpr):
    """Key-side log decays a = g + gk + gamma [BT, BK] of a block_pos tile (0 on
    masked rows), in DT (exact_dtype): the one gate's own values when DT is
    16-bit, else fp32."""
    BT: tl.constexpr = pos.shape[0]
    BK: tl.constexpr = o_k.shape[0]
    if G_MODE == 1:
        a = tl.load(g + row0 * H + i_h + pos * H, mask=mask_t, other=0.)
        a = tl.broadcast_to(a[:, None], [BT, BK])
    elif G_MODE == 2:
        a = load_tile(g, row0, pos, i_h, o_k, mask_t, mask_k, H, K)
    if DT != tl.float32:
        if G_MODE > 0:
            return floored(a)
        else:
            return floored(load_tile(gk, row0, pos, i_h, o_k, mask_t, mask_k, H, K))
    else:
        acc = tl.zeros([BT, BK], dtype=tl.float32)
        if G_MODE > 0:
            acc += a.to(tl.float32)
        if USE_GK:
            acc += load_tile(gk, row0, pos, i_h, o_k, mask_t, mask_k, H, K).to(tl.float32)
        if GAMMA_MODE > 0:
            acc += tl.where(mask_t, gamma, 0.)[:, None]
        return floored(acc)


@triton.jit
def seg_matrix(o_t, h, DT: tl.constexpr):
    """[BT, BT] 0/1 matrix of level h (a power of 2) for seg_sums, in its operand
    dtype for decays in DT (bfloat16 when DT is float32: those are split).
    Positions form aligned segments of h; a row t in an odd segment (bit h of t
    set) sums its segment from the start to t, a row in an even one sums t+1 to
    the segment's end. h = BT: every row sums t+1..BT-1 (the chunk's reverse
    exclusive sums); h = 2 BT: every row sums 0..t (inclusive)."""
    upper = ((o_t & h) != 0) | (h > o_t.shape[0])
    same = (o_t[:, None] ^ o_t[None, :]) < h
    keep = same & ((o_t[None, :] <= o_t[:, None]) == upper[:, None])
    if DT == tl.float32:
        return tl.where(keep, 1., 0.).to(tl.bfloat16)
    else:
        return tl.where(keep, 1., 0.).to(DT)


@triton.jit
def split_pieces(a, op: tl.constexpr, PIECES: tl.constexpr):
    """a [BT, D] (fp32, or fp64 rounded to fp32) as PIECES (1 or 3) tiles of dtype op
    summing to it: its rounding to op, then the rounding of what that lost, then the
    rest (8 + 8 + 8 of fp32's 24 significand bits for bfloat16, each piece exact);
    chunk_scan.decay_pieces says how many a table product needs."""
    a = a.to(tl.float32)
    a0 = a.to(op)
    if PIECES == 1:
        return a0, a0, a0
    r1 = a - a0.to(tl.float32)
    a1 = r1.to(op)
    return a0, a1, (r1 - a1.to(tl.float32)).to(op)


@triton.jit
def seg_sums(c, a, DT: tl.constexpr):
    """c @ a, fp32 [BT, BD], for a 0/1 matrix c (seg_matrix) and decays a
    [BT, BD] from decay_k_in: fp32 sums of a's own values. One tensor-core
    product when a is exact in DT; an fp32 a in three bfloat16 pieces
    (split_pieces)."""
    if DT == tl.float32:
        hi, mid, lo = split_pieces(a, tl.bfloat16, 3)
        s = tl.dot(c, hi)
        s = tl.dot(c, mid, s)
        return tl.dot(c, lo, s)
    else:
        return tl.dot(c, a)


@triton.jit
def start_sums(o_t, a, DT: tl.constexpr):
    """(the sums of a chunk's log decays a [BT, BD] from its start to each row, inclusive,
    [BT, BD]; and the chunk's whole sum, the last row's, [BD]). The whole sum is read off
    the same product: a sum over a's rows moves a across warps through shared memory."""
    BT: tl.constexpr = o_t.shape[0]
    s = seg_sums(seg_matrix(o_t, 2 * BT, DT), a, DT)
    return s, tl.sum(tl.where(o_t[:, None] == BT - 1, s, 0.), 0)


@triton.jit
def row_decays(DT: tl.constexpr, g, gamma, row0, pos, mask_t, i_h, H: tl.constexpr,
               K: tl.constexpr, G_MODE: tl.constexpr, GAMMA_MODE: tl.constexpr):
    """[BT] in DT: the log decays of a block_pos tile where they are the same for every
    key (g [B,T,H], g_gamma; no gk): decay_k_in's rows, read off 16 columns."""
    o_u = tl.arange(0, 16)
    return tl.max(decay_k_in(DT, g, g, gamma, row0, pos, mask_t, i_h, o_u, o_u < 16, H, K,
                             G_MODE, False, GAMMA_MODE), 1)


@triton.jit
def pair_sums(o_t, a, DT: tl.constexpr, TRANS: tl.constexpr = False):
    """[BT, BT] fp32: at (t, s) the sum of the log decays a [BT] (in DT, the same for every
    key) over s < r <= t, 0 for s >= t; TRANS: at (s, t). seg_sums of a 0/1 matrix and a's
    rows where they enter a column: row t sums rows 0..t of a below each column s (TRANS:
    row s sums rows s + 1.. of a at or above each column t)."""
    BT: tl.constexpr = o_t.shape[0]
    if TRANS:
        n = tl.where(o_t[:, None] <= o_t[None, :], a[:, None], 0.).to(DT)
        return seg_sums(seg_matrix(o_t, BT, DT), n, DT)
    else:
        n = tl.where(o_t[:, None] > o_t[None, :], a[:, None], 0.).to(DT)
        return seg_sums(seg_matrix(o_t, 2 * BT, DT), n, DT)


@triton.jit
def pair_decays(o_t, DT: tl.constexpr, g, gamma, row0, pos, mask_t, i_h, H: tl.constexpr,
                K: tl.constexpr, G_MODE: tl.constexpr, GAMMA_MODE: tl.constexpr,
                TRANS: tl.constexpr = False):
    """[BT, BT] fp32: at (t, s) the decay from s to t of a block_pos tile whose decays are
    the same for every key (row_decays), e^(pair_sums), 1 for s >= t; TRANS: at (s, t)."""
    return exp_(pair_sums(o_t, row_decays(DT, g, gamma, row0, pos, mask_t, i_h, H, K, G_MODE,
                                          GAMMA_MODE), DT, TRANS))


@triton.jit
def level_mask(o_t, h):
    """[BT, BT]: the pairs t > s whose highest differing position bit is h: row t
    in an odd segment of h, column s in the even one just before it."""
    x = o_t[:, None] ^ o_t[None, :]
    return (x >= h) & (x < 2 * h) & ((o_t & h) != 0)[:, None]


@triton.jit
def load_qk_tile(q, k, row0, pos, i_h, i_hk, o_k, mask_t, use_q, mask_k, H: tl.constexpr,
                 HK: tl.constexpr, K: tl.constexpr):
    """[BT, BK] rows of q where use_q [BT], of k elsewhere, in q's dtype: one load
    (each row's pointer is chosen) when q and k share a dtype."""
    if q.dtype.element_ty == k.dtype.element_ty:
        p_q = tile_ptrs(q, row0, pos, i_h, o_k, H, K)
        p_k = tile_ptrs(k, row0, pos, i_hk, o_k, HK, K)
        return tl.load(tl.where(use_q[:, None], p_q, p_k),
                       mask=mask_t[:, None] & mask_k[None, :], other=0.)
    else:
        b_q = load_tile(q, row0, pos, i_h, o_k, mask_t & use_q, mask_k, H, K)
        b_k = load_tile(k, row0, pos, i_hk, o_k, mask_t & ~use_q, mask_k, HK, K)
        return tl.where(use_q[:, None], b_q, b_k.to(q.dtype.element_ty))
