"""fused_chunk's split forward: each sequence cut into segments run by separate programs.

fused_chunk's one launch runs one program per (sequence x head, V block); where those are
fewer than the device's SMs (one long sequence, few heads), most of the GPU idles. The
split cuts each sequence into NS segments of whole 32-token chunks (in processing order,
so backwards with `reverse`; segment s takes chunks [s nc / NS, (s + 1) nc / NS) of a
sequence of nc chunks, empty ones where NS > nc) and runs three launches, the algebra of
context parallelism (bridge/context.py) inside one device:

  1. local    fused_chunk_fwd_kernel(LOCAL): per (sequence x head, segment 0..NS-2,
              K block, V block) the segment's final state from a zero state, F [N,H,NS-1,K,V]
              fp32, and its log decays summed, la [N,H,NS-1,K] and lb [N,H,NS-1,V]
              (a sum of consecutive log decays, floored: finite, so exp gives 0 for a
              reset, never NaN); no q, no o.
  2. combine  fused_chunk_combine_kernel: per (sequence x head, V block) the segments in
              order, S_0 = h0 (or 0), S_{s+1} = e^{la_s} S_s e^{lb_s} + F_s, written as the
              state entering every segment, S_in [N,H,NS,K,V] fp32.
  3. output   fused_chunk_fwd_kernel(NS): per (sequence x head, segment, V block) the
              plain forward over the segment from S_in: o, and final_state from the
              last segment (the combined state carried over its chunks).

Why recompute over a correction pass (each segment's o from a zero state, then
o += q gated S_in): the correction reads q, the gates and o and writes o again, 4 of
the call's [B,T,H,*] tensors, and rounds o twice (or keeps it fp32); the local pass
reads k, v and the gates of NS-1 of the NS segments, at most 3 of them, and o is
written once from the same registers as unsplit. Extra bytes: (NS-1)/NS of k, v and
the gates, plus F and S_in ((2 NS - 1) N H K V fp32 each way); extra products: the
state updates k^T v of NS-1 segments (the forward_launches figures).

The factor NS (`segments`) is a plan choice: the device table's "split" entry for the
call (bridge/tuning.py) or, without one, the rule: with P unsplit programs and `waves` x
the device's SMs slots, the NS that minimises the rounds of slots the split runs per
segment walk, (ceil(NS P / slots) + LOCAL ceil((NS - 1) P / slots)) / NS, the fewest on
ties, segments of at least `min_chunks` chunks (of the mean sequence with cu_seqlens,
whose lengths the plan does not know): 128 programs on 132 SMs stay unsplit (a second
round would only fill 4 more SMs), 8 take 33 segments (264 programs, two rounds). Where the
SM count is unknown (the CPU, the interpreter) the rule keeps one segment; the knob
`segments` forces a factor (tests, the GPU kit's sweep). Results equal the unsplit
launch's within fp32 rounding (SPEC.md).
"""

import math

import triton
import triton.language as tl

from .. import tuning
from ..launch import Launch, Out
from .common import exp_, key_gated, next_pow2

WAVES = 1       # the rule's slots: WAVES x SMs programs at once
LOCAL = 0.5     # the rule's cost of a local-pass program against an output one (it walks
#                 the same chunks without q, A or o; its SASS chain is about a quarter of
#                 the output pass's on sm_90), rounded up: a split must fill the device
#                 clearly better to pay for it
MIN_CHUNKS = 8  # the rule's shortest segment, in chunks: the local pass and the combine
#                 cost about one segment's state walk, so short segments gain nothing
# the sweep's candidates (fused_chunk.SITES): 0 waves is never split
SWEEP = dict(waves=(0, 1, 2, 4))
LOCAL_BK = 128  # the local pass's K block (no q there, so K may be blocked): K = 256 in
#                 one block spilled on sm_80
BV = 32         # the combine's V block: an fp32 [K, 32] tile, 64 registers a thread at K=256


def segments(plan, programs: int, BT: int) -> int:
    """NS of a call whose unsplit launch runs `programs` programs on chunks of BT tokens
    (module doc): the "split" knobs `segments` (> 0: forced), `waves`, `min_chunks`."""
    knobs = tuning.pick(plan, "fused_chunk", "split",
                        dict(segments=0, waves=WAVES, min_chunks=MIN_CHUNKS))
    for name, x in knobs.items():
        if isinstance(x, bool) or not isinstance(x, int) or x < 0:
            raise ValueError(f"tuning: fused_chunk/split {name} must be an int >= 0, got {x!r}")
    if knobs["segments"]:
        return knobs["segments"]
    sms = tuning.multiprocessors()
    if not sms or not knobs["waves"]:
        return 1
    chunks = -(-(plan.T // plan.N if plan.varlen else plan.T) // BT)
    return best_segments(programs, knobs["waves"] * sms,
                         max(1, chunks // max(knobs["min_chunks"], 1)))


def best_segments(programs: int, slots: int, most: int) -> int:
    """The NS in 1..most with the fewest rounds of `slots` programs per segment walk
    (module doc), the fewest on ties. Only NS <= n0 = slots / gcd(slots, programs) need
    trying: with NS = q n0 + r the cost is A + g(r) / NS, A = (1 + LOCAL) programs / slots
    and g depending on r alone, so NS = r (g(r) <= 0 and r > 0), or n0 (r = 0, or
    g(r) >= 0, where the cost is at least A and n0's at most), costs as little with fewer
    segments: at most `slots` tries instead of `most` (4096 at a million tokens)."""
    def walks(ns):  # rounds of `slots` programs, in walks of one unsplit program
        return (-(-ns * programs // slots) + LOCAL * -(-(ns - 1) * programs // slots)) / ns

    n0 = slots // math.gcd(slots, programs)
    return min(range(1, min(most, n0) + 1), key=lambda ns: (walks(ns), ns))


@triton.jit
def fused_chunk_combine_kernel(
    h0, hl, la, lb,
    hs,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NS: tl.constexpr,
    USE_H0: tl.constexpr, KGATE: tl.constexpr, USE_GV: tl.constexpr,
):
    """One (sequence x head, V block): hs [N,H,NS,K,V] fp32, the state entering each
    segment, from h0 [N,H,K,V] (or 0) and the segments' local final states hl
    [N,H,NS-1,K,V] with their log decays la [N,H,NS-1,K], lb [N,H,NS-1,V] (module doc)."""
    NV: tl.constexpr = (V + BV - 1) // BV
    pid = tl.program_id(0)
    i_nh, i_v = pid // NV, pid % NV
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k, mask_v = o_k < K, o_v < V
    mask_h = mask_k[:, None] & mask_v[None, :]
    p_kv = o_k[:, None] * V + o_v[None, :]
    b_s = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        b_s += tl.load(h0 + i_nh.to(tl.int64) * K * V + p_kv, mask=mask_h,
                       other=0.).to(tl.float32)
    for s in range(0, NS - 1):
        i = i_nh.to(tl.int64) * (NS - 1) + s
        tl.store(hs + (i + i_nh) * K * V + p_kv, b_s, mask=mask_h)
        if KGATE:
            b_s *= exp_(tl.load(la + i * K + o_k, mask=mask_k, other=0.))[:, None]
        if USE_GV:
            b_s *= exp_(tl.load(lb + i * V + o_v, mask=mask_v, other=0.))[None, :]
        b_s += tl.load(hl + i * K * V + p_kv, mask=mask_h, other=0.)
    tl.store(hs + (i_nh.to(tl.int64) * NS + NS - 1) * K * V + p_kv, b_s, mask=mask_h)


def combine_launch(plan, NS: int) -> Launch:
    """Reads [initial_state], split_F, [split_la, split_lb]; writes split_S [N,H,NS,K,V]."""
    N, H, K, V = plan.N, plan.H, plan.K, plan.V
    bv = min(BV, max(16, next_pow2(V)))
    nv = -(-V // bv)
    state = N * H * K * V * 4
    return Launch(
        fused_chunk_combine_kernel, grid=(N * H * nv,),
        inputs=dict(h0="initial_state" if plan.initial_state else None, hl="split_F",
                    la="split_la" if key_gated(plan) else None,
                    lb="split_lb" if plan.gv else None),
        scalars={}, outputs=dict(hs=Out("split_S", (N, H, NS, K, V))),
        constexprs=dict(K=K, V=V, BK=max(16, next_pow2(K)), BV=bv, NS=NS,
                        USE_H0=plan.initial_state, KGATE=key_gated(plan), USE_GV=plan.gv),
        num_warps=4, num_stages=1,
        bytes=int(state * (plan.initial_state + 2 * NS - 1)
                  + N * H * (NS - 1) * 4 * (K * key_gated(plan) + V * plan.gv)))
