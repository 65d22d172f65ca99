"""mode="fused_chunk": the chunked form in one launch, the state on chip through the chunk loop.

One program per (sequence x head, V block) walks its sequence's 32-token chunks in
processing order with the fp32 state S [K, BV] in registers; per chunk it loads q, k,
v and the gate tiles, builds the chunk's decays and its intra-chunk matrix A in
registers (the levels of chunk_fwd.py's module docstring: every exponent a sum of
consecutive log decays, summed on tensor cores by common.seg_sums), writes o and
updates S:

    o   = scale (q gated from the chunk's start) S + A v        (gv: by levels)
    S  <- e^(the chunk's key decays) S e^(its value decays) + (k gated)^T (v gated)

(gated to the chunk's end on the update side). With decays the same for every key (g
[B,T,H], g_gamma; not fp32 beside gv) A is q k^T times e^(each pair's decay sum: one
[BT, BT] matrix, common.pair_sums, no levels; gv's value levels then split that A), and
both gates are a factor a row, taken on the rows of q S and of v. The final state is the only extra
write (no per-chunk states h, no gated copies in HBM), but that under autograd with
per-key decays the forward also writes A [B,T,H,BT] for the backward (`kept`). The
name is the design's (flash-linear-attention calls its one-kernel GLA with the state in
registers `fused_chunk` too): the chunked algebra fused into one kernel.

Where those programs are fewer than the device's SMs, each sequence is split into
segments run by separate programs and their states combined (fused_chunk_split.py: three
launches of which this kernel is two, `NS` and `LOCAL`); the factor is the "split" site
of the device table (`SITES`).

Past K = 256 (up to 512, dispatch.HEAD_DIMS; past 64 in fp32) K is split over programs
instead (`SPLIT_K`):
one per (sequence x head, K block, V block), each with its own block of S, writing its
partial o to o_part [B,T,H,NK,V] fp32 (NK x 4 bytes an output element: 32 at K = 512),
which fused_chunk_ksum_kernel sums into o; no sequence split there.

Precision is the chunk family's: the same decay sums (exact fp32 sums of the
decays' own values, as 1 or 3 16-bit tensor-core products), the same dot operands
(the state as a dot operand in q's dtype, as chunk's h in bf16; fp32 "ieee"; for fp16
the state and A at tf32, common.op_dot).

Backward: fused_chunk_bwd.py's walks with S or dh in registers, where they apply
(fused_chunk_bwd.supported: no gv, K, V <= 128 in 16 bits, g_gamma alone in 16 bits),
else the chunk family's launch list (chunk.backward_launches, 64-token chunks, which
recomputes the states h and dh and A into HBM); GLA_BRIDGE_FUSED_CHUNK_BWD=chunk takes
the chunk list always. Autograd keeps the inputs and, with per-key decays where the
on-chip walks run, A (`kept`: 33.6 MB in bf16 at (8,4096,16,128,128), a quarter of q),
which the dv walk loads instead of building A's levels again. The buffers beyond the
returned gradients at (8,4096,16,128,128) bf16 (`parity.compiled --report`'s
workspace): 0.268 GB on chip (dq' in fp32; 0.81 GB with the gradients, against the
chunk family's 1.6 GB with its kept A and fla's 3.1 GB); 1.015 GB through the chunk
list (h and dh 268 MB each in bf16).

Config: chunks of BT = 32 tokens ([BT, K] operand tiles of 64 rows beside an fp32
state [128, 64] spilled on sm_90 at 8 warps; the chunk family's h / A stay in HBM
instead, so it takes 64), 16 where 32 spilled on sm_80 (`config`); all of K in one
block (K <= 256, 64 in fp32, else blocks of SPLIT_BK over programs); V blocks of BV,
warps and the intra-chunk K block BKI from `config`, pipelining stages from `config`.
Inside a chunk each block of BKI keys is loaded once and gives every level of A
(`intra`).
"""

import triton
import triton.language as tl

from .. import tuning
from ..launch import Launch, Out
from . import chunk, fused_chunk_bwd
from . import fused_chunk_split as split
from .common import (block_pos, check_k, decay_k_in, exact_dtype, exp_, flags, gate_inputs,
                     head_gamma, key_gated, level_mask, load_tile, next_pow2, op_dtype,
                     seg_matrix, seg_sums, seq_bounds, op_dot,
                     tile_ptrs, varlen_input, wide_dtype)
from .intra import intra, key_decays, key_gate, start_gate

BT = 32
# The launch sites the device table (bridge/tuning.py) may tune, with the candidate values
# the GPU kit's sweep tries: "split", the segments per sequence (fused_chunk_split.py);
# the forward's warps and intra-chunk K block (`config`); the backward walks'
# (fused_chunk_bwd.SITES)
SITES = {"split": split.SWEEP,
         "fused_chunk_fwd_kernel": dict(num_warps=(4, 8), BKI=(32, 64, 128), BV=(64, 128),
                                        stages=(2, 3), BT=(16, 32)),
         **fused_chunk_bwd.SITES}



@triton.jit
def _value_gated(b_vf, b, DV: tl.constexpr):
    """v [BT, BV] fp32 gated to the chunk's end by its value log decays b (decay_k_in on
    gv, in DV) and b summed over the chunk [1, BV]."""
    o_t = tl.arange(0, b_vf.shape[0])
    return (b_vf * exp_(seg_sums(seg_matrix(o_t, b_vf.shape[0], DV), b, DV)),
            tl.sum(b.to(tl.float32), 0)[None, :])


@triton.jit
def fused_chunk_fwd_kernel(
    q, k, v, g, gk, gv, g_gamma, h0, cu_seqlens,
    scale, T,
    o, ht, la, lb, a_kept,
    H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BKI: tl.constexpr, BV: tl.constexpr,
    G_MODE: tl.constexpr, USE_GK: tl.constexpr, USE_GV: tl.constexpr, GAMMA_MODE: tl.constexpr,
    USE_H0: tl.constexpr, IS_VARLEN: tl.constexpr, REVERSE: tl.constexpr,
    LEVELS: tl.constexpr, DOT_PREC: tl.constexpr, STAGES: tl.constexpr,
    NS: tl.constexpr, LOCAL: tl.constexpr, KEEP_A: tl.constexpr, A_T: tl.constexpr,
):
    """One (sequence x head, segment, V block): o [B,T,H,V] (q's dtype) chunk by chunk
    and ht [N,H,K,V] fp32, the state after the sequence (h0 [N,H,K,V] before it).
    k, v have HK heads; the gates H. Each sequence is cut into NS segments of whole
    chunks (fused_chunk_split.py); with NS > 1, h0 is the state entering each segment
    [N,H,NS,K,V] and the last segment writes ht. LOCAL: the segments 0..NS-2 walked
    from a zero state without q or o, writing their final states to ht [N,H,NS-1,K,V]
    and their log decays summed, la [N,H,NS-1,K] (key gates) and lb [N,H,NS-1,V] (gv),
    K in blocks of BK there (the update is independent per key). With K in NK > 1 blocks
    otherwise (NS = 1): o is o_part [B,T,H,NK,V] fp32, each K block's partial, and ht
    gets each block's rows. KEEP_A: the first V block also writes each chunk's A to
    a_kept [B,T,H,BT] (its dtype) for the backward (`kept`), A_T: as A^T (row s, column
    t's place in the chunk; fused_chunk_bwd.kept_a)."""
    scale = tl.cast(scale, tl.float32)  # a float scalar may come as fp64 (common.py)
    NV: tl.constexpr = (V + BV - 1) // BV
    NK: tl.constexpr = (K + BK - 1) // BK  # 1 but in LOCAL and with K split (config)
    NP: tl.constexpr = NS - 1 if LOCAL else NS  # programs per sequence x head and V block
    pid = tl.program_id(0)
    i_v, i_k = pid % NV, (pid // NV) % NK
    i_nh, i_s = pid // (NV * NK * NP), (pid // (NV * NK)) % NP
    i_n, i_h = i_nh // H, i_nh % H
    i_hk = i_h // (H // HK)
    KGATE: tl.constexpr = (G_MODE > 0) or USE_GK or (GAMMA_MODE > 0)
    PER_KEY: tl.constexpr = (G_MODE == 2) or USE_GK
    bos, eos = seq_bounds(cu_seqlens, i_n, T, IS_VARLEN)
    gamma = head_gamma(g_gamma, i_n, i_h, H, GAMMA_MODE)
    o_t = tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k, mask_v = o_k < K, o_v < V
    mask_h = mask_k[:, None] & mask_v[None, :]
    # a scalar int64 base and int32 offsets: a [K, BV] tile of 64-bit addresses would
    # stay live through the loop for the final store
    base = i_nh.to(tl.int64) * K * V
    seg = base * NP + i_s * (K * V)  # this segment's state (base when NS == 1)
    p_kv = o_k[:, None] * V + o_v[None, :]
    op: tl.constexpr = op_dtype(q.dtype.element_ty)
    wop: tl.constexpr = wide_dtype(op)  # A's products (common.op_dot)
    # decays the same for every key: factors on rows of q S and of v, A from the pairs'
    # sums (`intra`'s PAIRS); fp32 beside gv by levels (the pairs spilled 8-24 B on sm_80)
    SCALAR: tl.constexpr = KGATE and not PER_KEY and (not USE_GV or op != tl.float32)
    nc = tl.cdiv(eos - bos, BT)
    if NS == 1:
        c0, c1 = 0, nc
    else:  # chunks [i_s nc / NS, (i_s + 1) nc / NS): sizes differ by at most one
        c0, c1 = i_s * nc // NS, (i_s + 1) * nc // NS
    DT: tl.constexpr = exact_dtype(g.dtype.element_ty, gk.dtype.element_ty, G_MODE, USE_GK,
                                   GAMMA_MODE)
    DV: tl.constexpr = exact_dtype(gv.dtype.element_ty, gv.dtype.element_ty, 0, True, 0)
    # A's keys: all of K, or with K split over programs this program's block (its partial o)
    k0 = 0 if NK == 1 else i_k * BK
    nki = tl.cdiv(K, BKI) if NK == 1 else tl.cdiv(tl.minimum(K - k0, BK), BKI)

    # Pipelined with key decays, o is stored at the end of the body, after the state's
    # loads of k and its decays, so Triton merges those with the intra-chunk part's (a
    # store between two loads keeps both, and the pipeliner copies each into shared
    # memory). Without key decays only k's copy is saved, and o stored where it is
    # computed keeps the loop's chain shorter
    START: tl.constexpr = STAGES > 1 and not LOCAL  # the chunk's sums from start_gate
    O_LAST: tl.constexpr = START and KGATE
    b_s = tl.zeros([BK, BV], dtype=tl.float32)
    s_a = tl.zeros([BK, 1], dtype=tl.float32)
    s_b = tl.zeros([1, BV], dtype=tl.float32)
    if USE_H0 and not LOCAL:
        b_s += tl.load(h0 + seg + p_kv, mask=mask_h, other=0.).to(tl.float32)
    for c in tl.range(c0, c1, num_stages=STAGES):
        row0, pos, mask_t = block_pos(bos, eos, c * BT, BT, REVERSE)
        if LOCAL:  # the state's update alone, and the segment's log decays summed
            b_vg = load_tile(v, row0, pos, i_hk, o_v, mask_t, mask_v, HK, V)
            if USE_GV:
                b = decay_k_in(DV, gv, gv, 0., row0, pos, mask_t, i_h, o_v, mask_v, H, V, 0,
                               True, 0)
                b_vg, l_v = _value_gated(b_vg.to(tl.float32), b, DV)
                if not SCALAR:  # the dot's operand: rounded here, not later
                    b_vg = b_vg.to(op)
                b_s *= exp_(l_v)
                s_b += l_v
        else:
            b_a = intra(q, k, g, gk, gamma, row0, pos, mask_t, i_h, i_hk, scale, k0, nki, H, HK,
                        K, BKI, G_MODE, USE_GK, GAMMA_MODE, LEVELS, DOT_PREC, STAGES > 1,
                        SCALAR)
            b_q = load_tile(q, row0, pos, i_h, o_k, mask_t, mask_k, H, K)
            if not SCALAR:
                b_q = b_q.to(tl.float32) * scale
            if KGATE:  # gated from the chunk's start
                a_q = key_decays(DT, g, gk, gamma, row0, pos, mask_t, i_h, o_k, mask_k, H, K,
                                 G_MODE, USE_GK, GAMMA_MODE)
                if START:  # the chunk's sums too (else summed on the k side, not held
                    # in registers in between)
                    f, l_k = start_gate(o_t, DT, a_q, PER_KEY)
                else:
                    f, _ = key_gate(seg_matrix(o_t, 2 * BT, DT), DT, a_q, PER_KEY)
                if SCALAR:  # a factor a row: on (q S)'s rows, q as loaded (no fp32 copy)
                    acc = op_dot(b_q.to(op), b_s, None, op, DOT_PREC) * (f * scale)
                else:
                    b_q *= f
            if not SCALAR:
                acc = op_dot(b_q.to(op), b_s, None, op, DOT_PREC)
            b_v = load_tile(v, row0, pos, i_hk, o_v, mask_t, mask_v, HK, V)
            if USE_GV:
                b = decay_k_in(DV, gv, gv, 0., row0, pos, mask_t, i_h, o_v, mask_v, H, V, 0,
                               True, 0)
                acc *= exp_(seg_sums(seg_matrix(o_t, 2 * BT, DV), b, DV))
                b_vf = b_v.to(tl.float32)
                acc = op_dot(tl.where(o_t[:, None] == o_t[None, :], b_a, 0.).to(wop), b_v,
                             acc, op, DOT_PREC)
                for lvl in range(0, LEVELS):  # chunk_output_kernel's value levels
                    hl = (BT // 2) >> lvl
                    x = exp_(seg_sums(seg_matrix(o_t, hl, DV), b, DV))
                    b_al = tl.where(level_mask(o_t, hl), b_a, 0.).to(wop)
                    acc += x * op_dot(b_al, (b_vf * x).to(op), None, op, DOT_PREC)
                b_vg, l_v = _value_gated(b_vf, b, DV)
                b_s *= exp_(l_v)
            else:
                b_aw = b_a.to(wop)
                if KEEP_A:  # as A v takes it (fused_chunk_bwd.kept_a: wop), where it is made
                    if i_v == 0:
                        tl.store(tile_ptrs(a_kept, row0, pos, i_h, o_t, H, BT),
                                 tl.trans(b_aw) if A_T else b_aw, mask=mask_t[:, None])
                acc = op_dot(b_aw, b_v, acc, op, DOT_PREC)
                b_vg = b_v
            b_o = acc.to(o.dtype.element_ty)
            if not O_LAST:
                tl.store(tile_ptrs(o, row0, pos, i_h * NK + i_k, o_v, H * NK, V), b_o,
                         mask=mask_t[:, None] & mask_v[None, :])
        # k loaded (and its decays again, L1 hits) only now: q's tiles are dead by here
        b_k = load_tile(k, row0, pos, i_hk, o_k, mask_t, mask_k, HK, K)
        if not SCALAR:
            b_k = b_k.to(tl.float32)
        if KGATE:  # gated to the chunk's end
            f, l_kk = key_gate(seg_matrix(o_t, BT, DT), DT,
                               key_decays(DT, g, gk, gamma, row0, pos, mask_t, i_h, o_k,
                                          mask_k, H, K, G_MODE, USE_GK, GAMMA_MODE), PER_KEY)
            if not START:
                l_k = l_kk
            if SCALAR:  # a factor a row: on v's rows ([BT, BV]) instead of k's ([BT, K])
                b_vg = b_vg.to(tl.float32) * f
            else:
                b_k *= f
            b_s *= exp_(l_k)
            if LOCAL:
                s_a += l_k
        b_s = tl.dot(tl.trans(b_k.to(op)), b_vg.to(op), b_s, input_precision=DOT_PREC)
        if O_LAST:
            tl.store(tile_ptrs(o, row0, pos, i_h * NK + i_k, o_v, H * NK, V), b_o,
                     mask=mask_t[:, None] & mask_v[None, :])
    if LOCAL:
        tl.store(ht + seg + p_kv, b_s, mask=mask_h)
        if KGATE:  # every V block has the same sums: the first writes them
            if i_v == 0:
                tl.store(la + (i_nh.to(tl.int64) * NP + i_s) * K + o_k[:, None], s_a,
                         mask=mask_k[:, None])
        if USE_GV:  # every K block has the same sums: the first writes them
            if i_k == 0:
                tl.store(lb + (i_nh.to(tl.int64) * NP + i_s) * V + o_v[None, :], s_b,
                         mask=mask_v[None, :])
    elif NS == 1:
        tl.store(ht + base + p_kv, b_s, mask=mask_h)
    elif i_s == NS - 1:
        tl.store(ht + base + p_kv, b_s, mask=mask_h)


@triton.jit
def fused_chunk_ksum_kernel(x, M, o, V: tl.constexpr, NK: tl.constexpr, BM: tl.constexpr,
                            BV: tl.constexpr):
    """o [M, V] (o's dtype) = the sum over its NK K blocks of x [M, NK, V] fp32, the K-split
    forward's partial outputs (M = B T H rows), added in block order."""
    NV: tl.constexpr = (V + BV - 1) // BV
    pid = tl.program_id(0)
    o_m = (pid // NV).to(tl.int64) * BM + tl.arange(0, BM)
    o_v = (pid % NV) * BV + tl.arange(0, BV)
    mask = (o_m < M)[:, None] & (o_v < V)[None, :]
    acc = tl.zeros([BM, BV], dtype=tl.float32)
    for i_k in tl.static_range(NK):
        acc += tl.load(x + (o_m[:, None] * NK + i_k) * V + o_v[None, :], mask=mask, other=0.)
    tl.store(o + o_m[:, None] * V + o_v[None, :], acc.to(o.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------- launch plans

# Past K = 256 (SPLIT_K; past 64 in fp32, SPLIT_K_FP32: its FMA products keep a whole K
# row per thread, which spilled 0.4-1.4 KB at K = 96 and 128 on sm_80 and sm_90 on 32- or
# 16-token chunks) the forward splits K over programs (a K-block program axis): each
# program holds its [SPLIT_BK, BV] block of the state and the final state, and writes its
# partial o = (its q columns) S + (A over its keys) v in fp32 (everything is linear in the
# split); fused_chunk_ksum_kernel adds the partials. Below, all of K in one program.
# Blocks of 64 (128 spilled with gv and key decays, and in fp32), 32 with gv but in bf16; V
# blocks narrower than below SPLIT_K beside a K block's decays (`config`): every gate
# combination and dtype at K = 320 and 512 builds without spills on sm_80 and sm_90.
SPLIT_K = 256
SPLIT_K_FP32 = 64
SPLIT_BK = 64
KSUM_BM = 64  # the partial sum's rows a program: [64, 64] fp32, 16 registers a thread


def config(plan) -> dict:
    """Tiles: all of K in one block (the state is one register tile), or past K = SPLIT_K
    (SPLIT_K_FP32 in fp32) blocks of SPLIT_BK over programs (NK = ceil(K / BK) of them), V
    blocks of BV: 64 columns (an fp32 state [128, 64]: 32 registers a thread at 8 warps, 64
    at 4) where that builds without spills on sm_80 and sm_90 (`python -m parity.compiled
    --family fused_chunk`), else 32: with gv (its level products beside the state; 64 on
    sm_90, whose wgmma takes its operands from shared memory), with key decays the same
    for every key (g [B,T,H] or g_gamma), for fp32 (FMA products) and for K blocks over
    128. With K split, 64 columns only for 16-bit keys without decays, 16 for 16-bit with
    gv, and with gv K blocks of 32 but in bf16. 16 bits without gv or K split ("lean"): 4
    warps (two programs a SM without spills; A's [32, 32] products repeat on fewer warps
    than at 8; but 8 with sm_80's mma.sync and per-key decays at 32 < K <= 64, where 4
    spilled) and the intra-chunk products on K blocks BKI of 64 (every level of A from
    each block, `intra`: fewer, longer level runs); the lean tiles with decays the same
    for every key ("scalar": A is q k^T times one [BT, BT] matrix of decays, no levels)
    on key blocks of all of K (a head gate's at 64 < K <= 128 on 64 with sm_80's
    mma.sync, on 32 in bf16 on sm_90; with mma.sync on 32 at K = 64 and fp16's g_gamma
    past 64 keys) and the chunk loop pipelined (stages 3, below), on
    sm_80 up to K = 128; 16 bits with K split, or with gv on sm_80 and per-key (or no)
    key decays at K <= 32 or beside decays the same for every key (A from the pairs there
    too) at K <= 64: 4 warps (8 spilled with every gate under triton 3.6) and
    chunk.intra_bk's blocks; else 8 warps and chunk.intra_bk's blocks (gv's levels and
    fp32's FMA products spilled at 4 on sm_90), but BKI 64 for 16 bits with gv (32
    spilled on sm_80; there bf16 past 64 keys keeps 32, where 64 spilled more), all of K
    beside decays the same for every key past 64 keys. On sm_90
    (`tuning.wgmma`) the lean
    forward with per-key or no decays, with 32 < V <= 128 and K <= 128 takes all of V in
    one block at 8 warps with key blocks BKI of all of K: one program a head instead of
    one a V block, so A is built once (spilled 1.6 KB on sm_80), and its chunk loop
    software-pipelined (stages 3: the tiles of the chunk after next loaded during this
    one; unpipelined, each chunk's loads waited on the shared memory its previous products
    used, and at 2 the next chunk's loads issue at the end of the body, so the next run
    starts waiting on them): the key blocks and level loops unrolled, since Triton's
    pipeliner takes no loop that holds a loop (so never with gv's value levels or K
    split); with sm_80's mma.sync the lean tiles without decays pipelined too (fp16 past
    64 keys at 2 stages, bf16 past 64 keys at 8 warps: at 4 it spilled 12-60 B outside
    the loop; not at K = 16: 48 B in it); elsewhere 1, the unrolled products spilling
    beside narrower tiles.
    Chunks of BT = 32 tokens but 16 where 32 spilled with sm_80's mma.sync (operands in
    registers; `tuning.wgmma` false, as on the CPU): bf16 and the lean tiles with per-key
    decays over more than 64 keys (bf16's lean tiles: 0.6 KB spilled at K = 128 on
    32-token chunks; V blocks of 32 at 8 warps instead, spill-free on 32, ran about 3x
    the time model's chain) and fp32 with them and gv; on sm_90, fp16 with them over
    more than 64 keys with gv or on all of V (280 B spilled on 32); on both, 16 bits with
    gv beside decays the same for every key over more than 64 keys.
    num_warps, BKI, BV, stages and BT: the device table's
    "fused_chunk_fwd_kernel" entry where it has one (`SITES`)."""
    check_k(plan, "fused_chunk")
    half = plan.dtype in ("bfloat16", "float16")
    split = plan.K > (SPLIT_K if half else SPLIT_K_FP32)
    # fp32 state products (fp32's, fp16's at tf32) beside gv's: K blocks of 32 when split
    BK = (max(16, next_pow2(plan.K)) if not split
          else SPLIT_BK if plan.dtype == "bfloat16" or not plan.gv else SPLIT_BK // 2)
    keyed = plan.g == "key" or plan.gk
    per_key = keyed or not key_gated(plan)
    wgmma = tuning.wgmma()
    gv16 = half and plan.gv and not split
    wide = half and BK <= 128 and not plan.gv and (not key_gated(plan) if split else per_key)
    lean = half and not plan.gv and not split
    # wgmma reads its operands from shared memory: registers enough for gv's value levels
    # beside a [K, 64] state (with mma.sync, operands in registers, 64 spilled)
    # decays the same for every key: pipelined on key blocks of all of K, but past 128
    # keys with mma.sync (352-784 B spilled in the loop at K = 256)
    scalar = lean and not per_key and (wgmma or BK <= 128)
    # gv beside decays the same for every key (A from the pairs' sums, `intra`'s PAIRS)
    # past 64 keys: 16-token chunks on key blocks of all of K (32 tokens on 64-key blocks
    # spilled 84-628 B on sm_90, 6-84 local-memory instructions in the loop)
    wide_pairs = gv16 and not per_key and BK > 64
    # no decays with mma.sync: the lean tiles pipelined too, bf16 past 64 keys at 8 warps
    # (at 4: 12-60 B spilled outside the loop), fp16's at 2 stages (the model's chain at 3:
    # 0.517 against 0.257 ms at K = 128), not at K = 16 (48 B spilled in the loop)
    bare = lean and not key_gated(plan) and not wgmma and BK >= 32
    BV = min(16 if split and half and plan.gv else 64 if wide or (gv16 and wgmma)
             else 32, max(16, next_pow2(plan.V)))
    # all of V in one block on sm_90 (A built once a head, not once a V block), in bf16
    # and fp16; with mma.sync that spilled, and at K = V = 32 with per-key decays
    # (132-188 B)
    whole = lean and per_key and wgmma and plan.K <= 128 and 32 < plan.V <= 128
    # 16-token chunks where 32 spilled on sm_80 (mma.sync: operands in registers): bf16
    # and the lean tiles with per-key decays over more than 64 keys (0.6 KB; fp16's 180 B
    # on 8 warps), and fp32 with them and gv (its value levels' FMA products beside the
    # state: 132-168 B at K = 64; gv alone spilled on 16 tokens, none on 32); on sm_90
    # fp16 with them and gv over more than 64 keys, and so on the whole tiles (its tf32
    # products: 48-84 B, 280 B); and `wide_pairs`
    bt = (16 if keyed and (not wgmma and ((plan.dtype == "bfloat16" or lean) and BK > 64
                                          or plan.dtype == "float32" and plan.gv)
                           or wgmma and plan.dtype == "float16" and (plan.gv or whole)
                           and BK > 64) or wide_pairs
          else BT)
    # 8 warps for the lean tiles with mma.sync with per-key decays at K = 64 (4 spilled
    # 24-60 B); with mma.sync 16 bits with gv and per-key (or no) key decays at
    # K <= 32 on 4, as the lean tiles (8 spilled 48-72 B: fp16 without gates, bf16 with
    # every gate), and beside decays the same for every key at K <= 64 (8 spilled 8-64 B)
    warps = (8 if whole or (lean and not wgmma and keyed and BK == 64)
             or (bare and plan.dtype == "bfloat16" and BK > 64)
             else 4 if lean or (half and split)
             or (gv16 and not wgmma and BK <= (32 if per_key else 64))
             else 8)
    # gv in 16 bits: every level from 64-key blocks, as the lean tiles (32 spilled 24-60 B
    # on sm_80), but bf16 past 64 keys with mma.sync (64 spilled more); the scalar tiles
    # of a head gate (g [B,T,H], loaded with the tiles) at 64 < K <= 128 on 64-key blocks
    # with mma.sync (all of K ran 12-15% longer in the time model), on 32 in bf16 with
    # wgmma (all of K spilled 12 B at 96 keys; fp16's ran 3-22% longer on 32 or 64)
    head = (scalar and plan.g == "head" and 64 < BK <= 128
            and (not wgmma or plan.dtype == "bfloat16"))
    # the scalar tiles with mma.sync on 32-key blocks at K = 64 (all of K ran 1.1-1.3x
    # longer in the time model; at K = 48 32 ran longer) and fp16's g_gamma past 64 keys
    # (all of K spilled 240 B at K = 100, 24 local-memory instructions in the loop)
    narrow = scalar and not wgmma and (plan.K == 64 or plan.dtype == "float16"
                                       and plan.g != "head" and BK > 64)
    bki = (32 if head and wgmma or narrow
           else 128 if whole or (scalar and not head) or wide_pairs
           else 64 if lean or (gv16 and (wgmma or BK <= 64 or plan.dtype == "float16"))
           else chunk.intra_bk(plan))
    knobs = tuning.pick(plan, "fused_chunk", "fused_chunk_fwd_kernel",
                        dict(num_warps=warps, BKI=bki, BV=128 if whole else BV,
                             stages=(2 if bare and plan.dtype == "float16" and BK > 64
                                     else 3 if whole or scalar or bare else 1), BT=bt))
    BV = min(knobs["BV"], max(16, next_pow2(plan.V)))
    return dict(BK=BK, BKI=min(BK, knobs["BKI"]), BV=BV, NV=-(-plan.V // BV),
                num_warps=knobs["num_warps"],
                stages=knobs["stages"] if not plan.gv and not split else 1, BT=knobs["BT"])


def forward_launches(plan, keep: bool = True) -> list:
    """Reads q, k, v, [g, gk, gv, g_gamma, initial_state, cu_seqlens]; writes o
    [B,T,H,V] (q's dtype) and final_state [N,H,K,V] fp32 (with `keep`, also what
    `kept(plan)` names: False for a forward no backward follows): one launch, or with the
    sequences split across programs (fused_chunk_split.py) three, through split_F,
    split_la, split_lb and split_S, or with K split (past SPLIT_K) two, through o_part
    [B,T,H,NK,V] fp32."""
    c = config(plan)
    B, T, H, K, V, N = plan.B, plan.T, plan.H, plan.K, plan.V, plan.N
    NK = -(-K // c["BK"])
    # not both splits: the sequence split's combine holds all of K of a state
    bt = c["BT"]
    NS = split.segments(plan, c["NV"] * N * H, bt) if NK == 1 else 1
    levels = bt.bit_length() - 1
    chunks = T // bt + N if plan.varlen else B * -(-T // bt)
    # per chunk and V block: A (levels + diagonal, [bt,K]x[K,bt] each), A v (gv: per
    # level too; per K block), q S and k^T v ([bt,K]x[K,BV])
    a_products = levels + 1 if key_gated(plan) else 1
    av_products = levels + 1 if plan.gv else 1
    per_chunk = 2 * bt * H * c["NV"]
    flops = per_chunk * chunks * (bt * K * a_products + NK * bt * c["BV"] * av_products
                                  + 2 * K * c["BV"])
    state = N * H * K * V * 4
    reads = sum(plan.nbytes(n) for n in plan.inputs())

    def launch(grid, outputs, nbytes, flops, a=None, **kw):
        """One launch of the forward kernel; `a`: the Out of the A it keeps, or None."""
        return Launch(
            fused_chunk_fwd_kernel, grid=(grid * c["NV"] * N * H,),
            inputs=dict(q="q", k="k", v="v", **gate_inputs(plan), **varlen_input(plan),
                        h0=kw.pop("h0")),
            scalars=dict(scale=plan.scale, T=T),
            outputs=dict(dict(la=None, lb=None, a_kept=a), **outputs),
            constexprs=dict(dict(flags(plan), BT=bt, BK=c["BK"], BKI=c["BKI"], BV=c["BV"],
                                 LEVELS=levels, DOT_PREC=chunk.dot_precision(),
                                 STAGES=c["stages"], KEEP_A=a is not None,
                                 A_T=a is not None and fused_chunk_bwd.kept_transposed()),
                            **kw),
            num_warps=c["num_warps"], num_stages=c["stages"], dot_flops=int(flops),
            bytes=int(nbytes + (0 if a is None else a.nbytes(plan))))

    final = Out("final_state", (N, H, K, V))
    o = dict(o=Out("o", (B, T, H, V), "like:q"), ht=final)
    a = fused_chunk_bwd.kept_a(plan, bt) if keep and kept(plan) else None
    if NK > 1:  # v and gv read per K block
        part = Out("o_part", (B, T, H, NK, V))
        vside = sum(plan.nbytes(n) for n in plan.inputs() if n in ("v", "gv"))
        return [launch(NK, dict(o=part, ht=final),
                       reads + (NK - 1) * vside + part.nbytes(plan) + state, flops,
                       h0="initial_state" if plan.initial_state else None,
                       USE_H0=plan.initial_state, NS=1, LOCAL=False),
                _ksum_launch(plan, NK)]
    if NS == 1:
        return [launch(1, o, reads + plan.nbytes("o") + state, flops, a,
                       h0="initial_state" if plan.initial_state else None,
                       USE_H0=plan.initial_state, NS=1, LOCAL=False)]
    # the local pass: NS-1 of NS segments of k, v and the gates; no q, no o
    part = (NS - 1) / NS
    kv = sum(plan.nbytes(n) for n in plan.inputs() if n not in ("q", "initial_state"))
    sums = dict(la=Out("split_la", (N, H, NS - 1, K)) if key_gated(plan) else None,
                lb=Out("split_lb", (N, H, NS - 1, V)) if plan.gv else None)
    bk = min(c["BK"], split.LOCAL_BK)
    local = launch((NS - 1) * -(-K // bk), dict(o=None, ht=Out("split_F", (N, H, NS - 1, K, V)),
                                                **sums),
                   part * kv + (NS - 1) * state, part * per_chunk * chunks * K * c["BV"],
                   h0=None, USE_H0=False, NS=NS, LOCAL=True, BK=bk)
    output = launch(NS, o, reads - state * plan.initial_state + NS * state
                    + plan.nbytes("o") + state, flops, a,
                    h0="split_S", USE_H0=True, NS=NS, LOCAL=False)
    return [local, split.combine_launch(plan, NS), output]


def _ksum_launch(plan, NK: int) -> Launch:
    """Reads o_part [B,T,H,NK,V] fp32; writes o [B,T,H,V] (q's dtype)."""
    M, V = plan.B * plan.T * plan.H, plan.V
    bv = min(64, max(16, next_pow2(V)))
    return Launch(fused_chunk_ksum_kernel, grid=(-(-M // KSUM_BM) * -(-V // bv),),
                  inputs=dict(x="o_part"), scalars=dict(M=M),
                  outputs=dict(o=Out("o", (plan.B, plan.T, plan.H, V), "like:q")),
                  constexprs=dict(V=V, NK=NK, BM=KSUM_BM, BV=bv), num_warps=4, num_stages=1,
                  bytes=int(M * V * 4 * NK + plan.nbytes("o")))


def kept(plan) -> tuple:
    """The forward's buffers that autograd keeps for the backward (the forward writes
    them with `keep`): A [B,T,H,BT] (fused_chunk_bwd.kept_a) with per-key decays (A's
    levels; with decays the same for every key, or none, A is one product, cheaper to
    build again than to load) where the on-chip backward runs (fused_chunk_bwd.supported)
    and its dv walk's chunks tile the forward's (its BT at most the forward's, all of K in
    one forward program): the dv walk loads its chunk's block of A instead of building it
    again; else nothing."""
    if not (plan.g == "key" or plan.gk) or not fused_chunk_bwd.supported(plan):
        return ()
    c = config(plan)
    if c["BK"] < plan.K or fused_chunk_bwd.config(plan)["chunks"]["bwd_dv"] > c["BT"]:
        return ()
    return ("A",)


def backward_launches(plan, use_dht: bool, kept: tuple = ()) -> list:
    """The on-chip backward (fused_chunk_bwd.py) where it takes the plan, else the chunk
    family's launch list (module docstring); `kept`: `kept(plan)`, or () to build A again."""
    if fused_chunk_bwd.supported(plan):
        return fused_chunk_bwd.launches(plan, use_dht, config(plan)["BT"] if kept else 0)
    if kept:
        raise ValueError(f"kept: the chunk list reuses no fused_chunk buffer, got {kept}")
    return chunk.backward_launches(plan, use_dht, kept=())
