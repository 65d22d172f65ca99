"""mode="chunk": the launch plans of the chunked kernels (chunk_fwd.py, chunk_bwd.py).

Forward: state_launches (gate pre-passes, then the sequential state pass: h
at every chunk start and the final state),
intra_launch (the intra-chunk matrix A), output_launch (o). Backward: h and A
are recomputed (nothing but the inputs and the final state is kept from the
forward), the state pass runs backwards for dh, then parallel launches give
dA, dv and dq/dk with the gate gradients from chunk-local reverse sums plus one
carried term per chunk; see chunk_bwd.py.

Buffers the backward reads from these launches:
  kg, vg   [B,T,H,K|V] forward state operands (k, v gated to their chunk's end;
           only with g/gk, gv), in k's dtype; qg, dog the backward's (q scale,
           do gated from their chunk's start), in q's dtype;
  decay_k, decay_v  [slots,H,K|V] fp32: e^(each chunk's sum of decays);
  h, dh    [slots,H,K,V]: the state at every chunk start / its gradient at every
           chunk end (bf16 for bf16 inputs, fp32 otherwise);
  A        [B,T,H,BT]: scale q k^T with the decays, 0 above the diagonal; in q's
           dtype for bf16 inputs unless intra_launch(fp32=True), else fp32;
  odo      [B,T,H,V] fp32 (output_launch(prime=True), gv only).

Config (the same for the interpreter, torch and JAX launches, so that every
path runs one variant): chunks of BT = 64 tokens, K and V blocks of up to 64
(the output kernel takes V up to 128 at once), warps and stages per kernel from
`warps` and `stages` (chosen with the SASS of `python -m parity.compiled --report`).
These are the defaults; on a device that bridge/tuning.json names, its measured
entry for a launch site (`SITES`) replaces them. Every grid is one axis (x < 2^31
programs).
fp32 inputs take exact ("ieee") products; GLA_BRIDGE_TF32=1 opts into tf32.
States h/dh are stored in bf16 for bf16 inputs (they are bf16 dot operands
anyway), in fp32 otherwise (fp16's range is too small for a state).
"""

import os

from .. import tuning
from ..contract import ITEMSIZE
from ..launch import Launch, Out
from .chunk_bwd import chunk_dA_kernel, chunk_dgamma_kernel, chunk_dqk_kernel, chunk_dv_kernel
from .common import check_k, flags, gate_inputs, key_gated, next_pow2, present, varlen_input
from .chunk_fwd import (chunk_gate_kernel, chunk_intra_kernel, chunk_output_kernel,
                        chunk_state_kernel)

BT = 64  # chunk length
BC = 16  # sub-chunk length: no exponent differences two sums over more steps


def warps(name: str, plan) -> int:
    """Warps of each kernel, chosen with the SASS of `parity.compiled --report` (and
    per-variant builds): the fewest with which it builds without register spills
    for sm_80 and sm_90 at K = V = 64 and 128, and 4 wherever a product is a
    64-row wgmma (more warps there duplicated the elementwise work feeding it).
    fp32 products are FMA loops (no MMA) and need more threads. dA and dv with gv in
    16 bits: 4 warps on GV_BV columns (no spills and 2 CTAs per SM; 8 warps on 64
    columns ran 1 CTA, and dv spilled)."""
    fp32, gv = plan.dtype == "float32", plan.gv
    gv16 = gv and plan.dtype in DV_BV
    if name in ("chunk_state_kernel", "chunk_gate_kernel"):
        return 8 if fp32 else 4
    if name == "chunk_dqk_kernel":
        return 8 if fp32 else 4
    if name == "chunk_dv_kernel":
        return 8 if fp32 or (gv and not gv16) else 4
    if name == "chunk_dA_kernel":
        return 4 if gv16 else 8
    return {"chunk_intra_kernel": 4, "chunk_output_kernel": 4}[name]


def stages(name: str, plan) -> int:
    """Software-pipelining stages (cp.async prefetch of the loops' dot operands)
    of each kernel, chosen with the SASS report like `warps`."""
    return {"chunk_state_kernel": 2}.get(name, 1)


def intra_bk(plan) -> int:
    """K block of chunk_intra_kernel: the largest with which its level products
    build without spills on sm_80 and sm_90 (fp32 products are FMA loops) and
    keep at most 8 bar.sync in a loop body (32 in 2 stages: 9); 16 past WIDE_K."""
    return 16 if plan.dtype == "float32" or plan.K > WIDE_K else 32


DV_BV = {"bfloat16": 128, "float16": 128}  # one V block at V <= 128 (no scans redone)
GV_BV = 32  # dA's and dv's V block with gv in 16 bits: its decay tiles beside the accumulators
DQK_BK = 32  # [BT, 32] tiles: dq, dk, one level's factors and products fit in registers
DQK_BK_WIDE = 16  # fp32 (FMA products hold whole operand rows per thread), K > WIDE_K
DQK_BV = 32  # V blocks of the state products: fewer loaded registers beside the accumulators
WIDE_K = 256  # past it narrower blocks (`config`, `intra_bk`, `output_bv`, dq/dk's): no spills
LEVELS = BT.bit_length() - 1  # pairs inside a chunk split by their highest differing bit


# The launch sites the device table (bridge/tuning.py) may tune, each with the candidate
# values the GPU kit's sweep tries (a candidate that does not fit is dropped there):
# num_stages > 1 only matters where a loop streams tiles
SITES = {
    "chunk_gate_kernel": dict(num_warps=(2, 4, 8)),
    "chunk_state_kernel": dict(num_warps=(4, 8), num_stages=(1, 2, 3)),
    "chunk_intra_kernel": dict(num_warps=(4, 8), num_stages=(1, 2), BK=(16, 32, 64)),
    "chunk_output_kernel": dict(num_warps=(4, 8), num_stages=(1, 2), BV=(32, 64, 128)),
    "chunk_dA_kernel": dict(num_warps=(4, 8), num_stages=(1, 2), BV=(32, 64)),
    "chunk_dv_kernel": dict(num_warps=(4, 8), num_stages=(1, 2), BV=(64, 128)),
    "chunk_dqk_kernel": dict(num_warps=(4, 8), num_stages=(1, 2, 3), BK=(16, 32, 64),
                             BV=(32, 64)),
}


def knobs(plan, kernel, **tiles) -> dict:
    """num_warps, num_stages and the given tiles of one launch site: the defaults
    (`warps`, `stages`, the tiles passed), or the device table's entry."""
    name = kernel.__name__
    return tuning.pick(plan, "chunk", name, dict(num_warps=warps(name, plan),
                                                 num_stages=stages(name, plan), **tiles))


def config(plan) -> dict:
    """Tiles: K and V blocks of up to 64 (32 along V for fp32, whose products are
    FMA loops: ptxas spilled tens of KB on fully unrolled 64x64x64 fp32 products);
    K blocks of 32 past WIDE_K (the gate pre-pass's, the output's and dv's K loops
    spilled at 64 there on sm_80)."""
    check_k(plan, "chunk")
    BK = min(32 if plan.K > WIDE_K else 64, max(16, next_pow2(plan.K)))
    BV = min(32 if plan.dtype == "float32" else 64, max(16, next_pow2(plan.V)))
    return dict(BT=BT, BC=BC, BK=BK, BV=BV, NK=-(-plan.K // BK), NV=-(-plan.V // BV))


def slots(plan) -> int:
    """Chunk slots of the per-chunk buffers (see common.first_slot): a static bound."""
    if plan.varlen:
        return plan.T // BT + plan.N
    return plan.B * -(-plan.T // BT)


def dot_precision() -> str:
    return "tf32" if os.environ.get("GLA_BRIDGE_TF32", "0") == "1" else "ieee"


def _state_dtype(plan) -> str:
    return "like:q" if plan.dtype == "bfloat16" else "float32"


def _size(plan) -> int:
    """Bytes per element of q (and of k, v, the gates and do: the plan's dtype)."""
    return ITEMSIZE[plan.dtype]


def _a_dtype(plan, fp32: bool) -> str:
    """A's storage: bf16 for bf16 inputs, else fp32 (fp16's pair products pass 65,504)."""
    return "like:q" if plan.dtype == "bfloat16" and not fp32 else "float32"


def _state_size(plan) -> int:
    return 4 if _state_dtype(plan) == "float32" else _size(plan)


def _only(kernel, consts: dict) -> dict:
    """The constexprs among `consts` that `kernel` takes."""
    return {n: x for n, x in consts.items() if n in kernel.arg_names}


def _consts(plan, c) -> dict:
    return dict(flags(plan), BT=BT, BC=BC, BK=c["BK"], BV=c["BV"], USE_H0=plan.initial_state,
                LOG_N=max(1, int(plan.N).bit_length()), LEVELS=LEVELS, DOT_PREC=dot_precision())


def _launch(plan, kernel, grid, inputs, scalars, outputs, consts, flops=0, nbytes=0,
            tuned=None, **extra):
    """A Launch of `kernel`; `tuned` is its `knobs` (picked here when None; tiles in
    it are constexprs of the kernel)."""
    k = dict(knobs(plan, kernel) if tuned is None else tuned)
    nw, ns = k.pop("num_warps"), k.pop("num_stages")
    return Launch(kernel, grid=grid, inputs=inputs, scalars=scalars, outputs=outputs,
                  constexprs=_only(kernel, dict(consts, **extra, **k)),
                  num_warps=nw, num_stages=ns, dot_flops=int(flops), bytes=int(nbytes))


def gate_launch(plan, value: bool, backward: bool) -> Launch:
    """chunk_gate_kernel for one side: forward, k (or v with `value`) gated to its
    chunk's end as "kg" ("vg"); backward, q * scale (or do) gated from its chunk's
    start as "qg" ("dog"), [B,T,H,D] in the state pass's operand dtype (the
    forward's k, the backward's q); both with "decay_k" ("decay_v")
    [slots,H,D] fp32, e^(each chunk's sum of decays)."""
    c = config(plan)
    B, T, H, N = plan.B, plan.T, plan.H, plan.N
    D, BD = (plan.V, c["BV"]) if value else (plan.K, c["BK"])
    ns, nd = slots(plan), -(-D // BD)
    x = ("do" if value else "q") if backward else ("v" if value else "k")
    heads = H if backward else plan.Hk
    name = {(False, False): "kg", (False, True): "vg", (True, False): "qg",
            (True, True): "dog"}[(backward, value)]
    return _launch(plan, chunk_gate_kernel, (ns * H * nd,),
                   dict(x=x, **gate_inputs(plan), **varlen_input(plan)),
                   dict(scale=plan.scale, T=T, N=N),
                   dict(xg=Out(name, (B, T, H, D), "like:q" if backward else "like:k"),
                        decay=Out("decay_v" if value else "decay_k", (ns, H, D))),
                   _consts(plan, c), flops=2 * ns * H * BT * BT * D,
                   nbytes=B * T * (heads + 2 * H) * D * _size(plan) + ns * H * D * 4,
                   HX=heads, D=D, BD=BD, VALUE=value, BACKWARD=backward)


def state_launches(plan, backward: bool, use_s_in: bool, store_out: bool) -> list:
    """The sequential pass, after its parallel gate pre-passes (gate_launch, for
    g/gk and for gv): h at chunk starts + final state (forward), or dh at chunk
    ends + d(initial_state) (backward)."""
    c = config(plan)
    B, T, H, K, V, N = plan.B, plan.T, plan.H, plan.K, plan.V, plan.N
    if K > WIDE_K:  # the state pass keeps K blocks of 64 (32 spilled there on sm_80)
        c = dict(c, BK=64, NK=-(-K // 64))
    ns, isz = slots(plan), _size(plan)
    ssz = _state_size(plan)
    pre_k = plan.g != "none" or plan.gk
    pre = ([gate_launch(plan, False, backward)] if pre_k else []) + (
        [gate_launch(plan, True, backward)] if plan.gv else [])
    if backward:
        x, y = ("qg" if pre_k else "q"), ("dog" if plan.gv else "do")
        hx, hy = H, H
        outputs = dict(states=Out("dh", (ns, H, K, V), _state_dtype(plan)),
                       s_out=Out("d_initial_state", (N, H, K, V)) if store_out else None)
        s_in = "dfinal_state" if use_s_in else None
    else:
        x, y = ("kg" if pre_k else "k"), ("vg" if plan.gv else "v")
        hx, hy = (H if pre_k else plan.Hk), (H if plan.gv else plan.Hk)
        outputs = dict(states=Out("h", (ns, H, K, V), _state_dtype(plan)),
                       s_out=Out("final_state", (N, H, K, V)) if store_out else None)
        s_in = "initial_state" if use_s_in else None
    inputs = dict(x=x, y=y, decay_k="decay_k" if pre_k else None,
                  decay_v="decay_v" if plan.gv else None, **present(plan, "g_gamma"), s_in=s_in,
                  **varlen_input(plan))
    nbytes = (B * T * (hx * K + hy * V) * isz + ns * H * K * V * ssz + 2 * N * H * K * V * 4)
    return pre + [_launch(plan, chunk_state_kernel, (c["NK"] * c["NV"] * N * H,), inputs,
                          dict(scale=plan.scale, T=T), outputs, _consts(plan, c),
                          flops=2 * ns * BT * H * K * V, nbytes=nbytes, HX=hx, HY=hy,
                          USE_S_IN=use_s_in, STORE_OUT=store_out, BACKWARD=backward)]


def intra_launch(plan, fp32: bool = False) -> Launch:
    """A [B,T,H,BT]: fp32 when `fp32` (a gradient reads its values), else in
    q's dtype for bf16 inputs (its consumers only take it as a dot operand)."""
    c = config(plan)
    B, T, H, K = plan.B, plan.T, plan.H, plan.K
    ns, levels = slots(plan), BT.bit_length() - 1
    products = 2 * levels - 1 if key_gated(plan) else 1  # each level + its segmented sums
    tuned = knobs(plan, chunk_intra_kernel, BK=intra_bk(plan))
    return _launch(plan, chunk_intra_kernel, (ns * H,),
                   dict(q="q", k="k", **present(plan, "g", "gk", "g_gamma"),
                        **varlen_input(plan)),
                   dict(scale=plan.scale, T=T, N=plan.N),
                   dict(A=Out("A", (B, T, H, BT), _a_dtype(plan, fp32))),
                   _consts(plan, c),
                   flops=2 * ns * H * BT * BT * K * products, tuned=tuned,
                   nbytes=B * T * (H + plan.Hk) * K * _size(plan)
                   + B * T * H * BT * (4 if _a_dtype(plan, fp32) == "float32" else 2))


def output_bv(plan) -> int:
    """V block of chunk_output_kernel: all of V up to 128 in one block, so the
    key-side decay sums run once per chunk; 32 with gv's level products (16 past
    WIDE_K), 16 for fp32 (FMA products): the largest that build without spills."""
    if plan.dtype == "float32":
        return 16
    if plan.gv:
        return 16 if plan.K > WIDE_K else 32
    return min(128, max(16, next_pow2(plan.V)))


def output_launch(plan, prime: bool = False) -> Launch:
    """o (prime=False), or o'*do in fp32 for the gv gate gradient (prime=True)."""
    c = config(plan)
    B, T, H, K, V = plan.B, plan.T, plan.H, plan.K, plan.V
    ns, isz = slots(plan), _size(plan)
    tuned = knobs(plan, chunk_output_kernel, BV=output_bv(plan))
    bv = tuned["BV"]
    out = Out("odo", (B, T, H, V)) if prime else Out("o", (B, T, H, V), "like:q")
    ssz = _state_size(plan)
    nbytes = (B * T * (H * K + plan.Hk * V + H * V * (2 if prime else 1)) * isz
              + B * T * H * BT * isz + ns * H * K * V * ssz)
    return _launch(plan, chunk_output_kernel, (ns * H * -(-V // bv),),
                   dict(q="q", v="v", **gate_inputs(plan), A="A", h="h", **varlen_input(plan),
                        do="do" if prime else None),
                   dict(scale=plan.scale, T=T, N=plan.N), dict(o=out), _consts(plan, c),
                   flops=2 * ns * BT * H * V * (K + BT), nbytes=nbytes, PRIME=prime, tuned=tuned)


def forward_launches(plan, keep: bool = True) -> list:
    """Reads q, k, v, [g, gk, gv, g_gamma, initial_state, cu_seqlens]; writes
    o [B,T,H,V] (q's dtype) and final_state [N,H,K,V] fp32 (h, A on the way: A, which
    `kept` names, whether or not `keep`)."""
    return [*state_launches(plan, backward=False, use_s_in=plan.initial_state, store_out=True),
            intra_launch(plan), output_launch(plan)]


def kept(plan) -> tuple:
    """The forward's buffers that autograd keeps for the backward, which then
    reuses them instead of recomputing (the plan choice GLA_BRIDGE_CHUNK_KEEP):
      "A" (default): A [B,T,H,BT] in q's dtype, 2 bytes a token, head and chunk
          position for bf16 (BT/K times q's size: 0.5x at K = 128), 4 for
          fp16 and fp32; saves the backward's intra-chunk launch (its reads of q and k and
          its write of A). Not with g_gamma, whose gradient needs A in fp32.
      "inputs": nothing beyond the inputs (and the final state, as before):
          the backward recomputes A.
    The states h are recomputed either way (slots x H x K x V: 2x q's size at
    K = V = 128 in bf16, as much again as A at BT = 64)."""
    if os.environ.get("GLA_BRIDGE_CHUNK_KEEP", "A") == "inputs" or plan.g_gamma != "none":
        return ()
    return ("A",)


def backward_launches(plan, use_dht: bool, kept: tuple = ()) -> list:
    """Reads the forward inputs, do [B,T,H,V], (use_dht) dfinal_state [N,H,K,V]
    and the forward buffers named in `kept` (see `kept`); writes the buffers
    bridge.grads reads."""
    c = config(plan)
    B, T, H, K, V, N = plan.B, plan.T, plan.H, plan.K, plan.V, plan.N
    ns, isz = slots(plan), _size(plan)
    consts = _consts(plan, c)
    gates, cu = gate_inputs(plan), varlen_input(plan)
    own = plan.group == 1  # per-query-head dk/dv are the gradients themselves
    ssz = _state_size(plan)
    tokens = B * T
    launches = [*state_launches(plan, backward=False, use_s_in=plan.initial_state,
                                store_out=False),
                # A: a dot operand of dv, and fp32 values for dgamma
                None if "A" in kept else intra_launch(plan, fp32=plan.g_gamma != "none"),
                *state_launches(plan, backward=True, use_s_in=use_dht,
                                store_out=plan.initial_state)]
    launches = [launch for launch in launches if launch is not None]
    if plan.gv:
        launches.append(output_launch(plan, prime=True))
    # the scan table (chunk_bwd.scan_matrix): in q's dtype for 16-bit inputs, else
    # bf16 (its products run on tensor cores: fp32 values go in as 3 exact pieces)
    n_scan = 2 * LEVELS + 3
    # fp32 with gv past WIDE_K: V blocks of 16 (dv's products over K blocks spilled at 32)
    da_bv = GV_BV if plan.dtype in DV_BV else 16 if K > WIDE_K else c["BV"]
    tuned_da = knobs(plan, chunk_dA_kernel, BV=min(c["BV"], da_bv) if plan.gv else c["BV"])
    launches.append(_launch(
        plan, chunk_dA_kernel, (ns, H), dict(v="v", **present(plan, "gv"), do="do", **cu),
        dict(T=T, N=N), dict(dA=Out("dA", (B, T, H, BT)),
                             tab=Out("scan_table", (n_scan, BT, BT),
                                     "like:q" if plan.dtype in ("bfloat16", "float16")
                                     else "bfloat16")), consts,
        flops=2 * ns * H * BT * BT * V * (1 + (LEVELS + 1 if plan.gv else 0)),
        nbytes=tokens * (H + plan.Hk) * V * isz + tokens * H * BT * 4, tuned=tuned_da))
    # with gv, dv's V blocks are dA's (its decay tiles beside the accumulators)
    tuned_dv = knobs(plan, chunk_dv_kernel, **({} if plan.gv else dict(
        BV=min(DV_BV.get(plan.dtype, c["BV"]), max(16, next_pow2(V))))))
    dv_bv = tuned_da["BV"] if plan.gv else tuned_dv["BV"]
    launches.append(_launch(
        plan, chunk_dv_kernel, (ns, -(-V // dv_bv), H),
        dict(k="k", v="v", **gates, A="A", h="h", dh="dh", odo="odo" if plan.gv else None,
             tab="scan_table", **cu, do="do"),
        dict(T=T, N=N), dict(dv=Out("dv_h", (B, T, H, V), "like:v" if own else "float32"),
                             db=Out("db", (B, T, H, V)) if plan.gv else None),
        dict(consts, BV=dv_bv),
        flops=2 * ns * BT * H * V * (BT + K),
        nbytes=(tokens * (plan.Hk * K + H * V * 2) * isz + tokens * H * BT * 4
                + ns * H * K * V * ssz), tuned=tuned_dv))
    wide = K > WIDE_K or plan.dtype in ("float32", "float64")
    tuned_dqk = knobs(plan, chunk_dqk_kernel,
                      BV=min(c["BV"], DQK_BV // 2 if K > WIDE_K else DQK_BV),
                      BK=min(c["BK"], DQK_BK_WIDE if wide else DQK_BK))
    nk = -(-K // tuned_dqk["BK"])
    launches.append(_launch(
        plan, chunk_dqk_kernel, (ns, nk, H),
        dict(q="q", k="k", v="v", **gates, h="h", dh="dh",
             A="A" if plan.g_gamma != "none" else None, dA="dA", tab="scan_table", **cu,
             do="do"),
        dict(scale=plan.scale, T=T, N=N),
        dict(dq=Out("dq", (B, T, H, K), "like:q"),
             dk=Out("dk_h", (B, T, H, K), "like:k" if own else "float32"),
             da=Out("da", (B, T, H, K), "like:g" if plan.g == "key" else "like:gk")
             if plan.g == "key" or plan.gk else None,
             dg_part=Out("dg_head", (nk, B, T, H)) if plan.g == "head" else None,
             dgamma_part=Out("dgamma_part", (nk, ns, H)) if plan.g_gamma != "none" else None),
        consts,
        flops=2 * ns * BT * H * K * (2 * V + (2 + 3 * LEVELS) * BT),
        nbytes=(tokens * (2 * H * K + plan.Hk * (K + V) + H * V) * isz
                + tokens * H * BT * 4 + 2 * ns * H * K * V * ssz), tuned=tuned_dqk))
    if plan.g_gamma != "none":
        launches.append(Launch(
            chunk_dgamma_kernel, grid=(N, H), inputs=dict(dgamma_part="dgamma_part", **cu),
            scalars=dict(T=T, NS=ns), outputs=dict(dgamma=Out("dgamma", (N, H))),
            constexprs=dict(H=H, BT=BT, NK=nk, IS_VARLEN=plan.varlen), num_warps=1,
            bytes=(nk * ns + N) * H * 4))
    return launches
