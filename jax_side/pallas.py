"""Gated linear attention as Pallas TPU kernels (platform="pallas").

Tokens go into chunk slots [S, R, H, C, D] with the XLA path's layout (flip for
reverse, a gather table for traced cu_seqlens), C = 64 tokens a chunk for every
K and V up to 256: 64 rows is what the MXU products need, while the key-wise
in-chunk products grow with C (C/16 - 1 C-row products per chunk: 3 at 64, 7 at
128) and the [16, 16, D] diagonal blocks do not shrink; the blocks stay under
1.5 MiB of VMEM at K = V = 256. q, k, v
keep their dtype (bf16 reaches the MXU as bf16), the log gates and the state
are float32. Blocks span the whole K and V (or 128-lane value blocks when V is
a multiple of 128): Mosaic pads them to the (8, 128) tile in VMEM, nothing is
padded on the host. Three kernels, each with grid (row, head, value block,
slot), the slot axis sequential ("arbitrary") and the others "parallel" (both
TensorCores of a megacore chip get work), scalar-prefetched tables (first chunk
/ sequence / last chunk of each slot) steering the initial and final states of
varlen sequences:

  forward      chunk outputs, fp32 state carried in VMEM scratch (optionally
               every chunk's entering state, for the backward)
  state grad   the reverse pass over slots for the state gradient
  chunk grad   dq, dk, dv and the gate gradients, chunk-local

Under differentiation the forward also stores the state entering every chunk
and the backward the state gradient leaving it ([S, R, H, K, V] each, bf16 for
bf16 inputs else fp32: the GPU design's h + dh); the backward recomputes
everything else per chunk.
Mosaic or the interpreter is chosen when the jitted function is lowered, per
platform (`lax.platform_dependent`): one function exports Mosaic kernels for
"tpu" and runs the interpreter on any other backend.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from bridge.decay import RESET_FLOOR

from . import pallas_kernels as pk
from . import sharding
from .sharding import struct, vary_all
from .chunk_layout import Layout

CHUNK = pk.C
LANE = 128
F32 = jnp.float32
# Per kernel launch: (name, grid, VMEM bytes of the double-buffered blocks and
# scratch, CostEstimate), appended at trace time while `recording()` is active.
_RECORD: list | None = None
_DEBUG = False


@contextlib.contextmanager
def recording(debug=False):
    """Collect every launch's (name, grid, vmem bytes, cost) traced inside; with
    `debug`, Pallas prints each Mosaic module as it lowers (`jax_side.tpu_report`)."""
    global _RECORD, _DEBUG
    old = (_RECORD, _DEBUG)
    _RECORD, _DEBUG = [], debug
    try:
        yield _RECORD
    finally:
        _RECORD, _DEBUG = old


def state_dtype(dtype):
    """The per-chunk states the backward keeps: bf16 for bf16 inputs (they reach the
    MXU as bf16 anyway; half the HBM traffic), else float32."""
    return jnp.bfloat16 if jnp.dtype(dtype) == jnp.bfloat16 else F32


def value_block(V):
    """The value block: 128 lanes when V splits into them, else all of V."""
    return LANE if V % LANE == 0 else V


class _Specs:
    """BlockSpecs for the grid (R, H, nV, S); `rev` visits slots last to first."""

    def __init__(self, S, R, G, K, BV, rev=False):
        self.S, self.R, self.G, self.K, self.BV, self.rev = S, R, G, K, BV, rev

    def _s(self, s):
        return self.S - 1 - s if self.rev else s

    def tok(self, width, kv=False, vblock=False):
        """A chunk of a [S, R, H(k), C, D] array."""
        sq = pl.Squeezed()
        G = self.G

        def index(r, h, vb, s, *_):
            # lax.div: jnp's floor division lowers through `sign`, which needs a TPU present
            g = lax.div(h, jnp.asarray(G, h.dtype)) if kv and G > 1 else h  # int32 under x64 too
            return (self._s(s), r, g, 0, vb if vblock else 0)

        return pl.BlockSpec((sq, sq, sq, CHUNK, width), index)

    def part(self, width):
        """A chunk of a [nV, S, R, H, C, width] per-value-block partial sum."""
        sq = pl.Squeezed()
        return pl.BlockSpec((sq, sq, sq, sq, CHUNK, width),
                            lambda r, h, vb, s, *_: (vb, self._s(s), r, h, 0, 0))

    def seq_state(self):
        """A [K, BV] block of a [N, H, K, V] array, picked by the slot's sequence."""
        sq = pl.Squeezed()

        def index(r, h, vb, s, first, seq, last):
            return (seq[self._s(s) * self.R + r], h, 0, vb)

        return pl.BlockSpec((sq, sq, self.K, self.BV), index)

    def slot_state(self):
        """A [K, BV] block of a [S, R, H, K, V] array of per-slot states."""
        sq = pl.Squeezed()
        return pl.BlockSpec((sq, sq, sq, self.K, self.BV),
                            lambda r, h, vb, s, *_: (self._s(s), r, h, 0, vb))


def _block_bytes(spec, x):
    shape = [d for d in spec.block_shape if d is not None and not isinstance(d, pl.Squeezed)]
    return math.prod(shape) * jnp.dtype(x.dtype).itemsize


def _call(name, kernel, grid, in_specs, out_specs, tabs, args, out_shape, scratch, interpret,
          cost):
    """The pallas_call of one kernel over `args` (after the scalar tables `tabs`);
    interpret=None picks Mosaic on TPU and the interpreter elsewhere when the
    surrounding function is lowered."""
    vmem = 2 * (sum(_block_bytes(sp, a) for sp, a in zip(in_specs, args))
                + sum(_block_bytes(sp, o) for sp, o in zip(out_specs, out_shape)))
    vmem += sum(math.prod(sc.shape) * jnp.dtype(sc.dtype).itemsize for sc in scratch)
    if _RECORD is not None:
        _RECORD.append(dict(kernel=name, grid=grid, vmem_bytes=vmem, flops=cost.flops,
                            transcendentals=cost.transcendentals,
                            bytes_accessed=cost.bytes_accessed))

    def build(interp):
        params = {}
        if interp is False:
            params["compiler_params"] = pltpu.CompilerParams(
                dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"))
        gs = pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=3, grid=grid, in_specs=in_specs,
                                          out_specs=out_specs, scratch_shapes=scratch)
        return pl.pallas_call(kernel, grid_spec=gs, out_shape=out_shape, interpret=interp,
                              cost_estimate=cost, debug=_DEBUG and interp is False,
                              name=name, **params)

    varying = sharding.varying(*args)
    interp = lambda mode: sharding.lower_without_vma_check(build(mode), varying)
    if interpret is None:
        return lax.platform_dependent(*tabs, *args, tpu=build(False), default=interp(True))
    return (build(False) if interpret is False else interp(interpret))(*tabs, *args)


def _cost(kind, grid, K, BV, has_b, scalar, args, outs):
    """pl.CostEstimate of one launch: MXU and elementwise FLOPs, exponentials and
    HBM bytes (every block read or written once per program)."""
    C, SUB, n = CHUNK, pk.SUB, math.prod(grid)
    sel = lambda D: 2 * 7 * C * C * D  # the selector matmul of one Decay
    exps = lambda D: 7 * C * D + pk.NSUB * SUB * SUB * D
    pair = lambda D: pk.NSUB * 3 * SUB * SUB * D  # the diagonal blocks' elementwise pairs
    state = 2 * C * K * BV  # one [C, K] x [K, BV]-sized product
    if kind == "state_grad":
        f = (4 * C * C if scalar else 2 * C * C * K) + state + (2 * C * C * BV if has_b else 0)
        t = (2 * C if scalar else C * K) + (C * BV if has_b else 0)
    elif scalar:  # decays 4C^2 + 2C^3; then q S, q k^T, P v, k^T v (forward)
        f = 4 * C * C + 2 * C ** 3 + 2 * state + 2 * C * C * (K + BV)
        t = 2 * C + C * C
        if kind == "chunk_grad":  # + U M; then 4 state-sized and 5 [C, C]-sized products
            f = 4 * C * C + 4 * C ** 3 + 4 * state + 2 * C * C * (3 * K + 2 * BV)
    else:
        f = sel(K) + pair(K) + 2 * state + 2 * C * C * K * (pk.NSUB - 1)
        f += 2 * C * C * BV * (pk.NSUB - 1 if has_b else 1) + pk.NSUB * 2 * SUB * SUB * BV
        t = exps(K) + (exps(BV) if has_b else 0)
        if has_b:
            f += sel(BV) + pair(BV)
        if kind == "chunk_grad":
            f, t = 3 * f, t + (pk.NSUB * SUB * SUB * BV if has_b else 0)
    nbytes = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in (*args, *outs))
    return pl.CostEstimate(flops=int(f * n), transcendentals=int(t * n), bytes_accessed=int(nbytes))


def _scalar(a, b):
    """One key-side log gate per token and no value gate: the [C, C]-matrix kernels."""
    return a.shape[-1] == 1 and b is None


def _forward(cfg, tabs, q, k, v, a, b, h0, states=False):
    G, scale, interpret = cfg
    S, R, H, C, K = q.shape
    V, N = v.shape[-1], h0.shape[0]
    BV, A = value_block(V), a.shape[-1]
    sp = _Specs(S, R, G, K, BV)
    has_b = b is not None
    ins = [sp.tok(K), sp.tok(K, kv=True), sp.tok(BV, kv=True, vblock=True), sp.tok(A)]
    args = [q, k, v, a]
    if has_b:
        ins.append(sp.tok(BV, vblock=True))
        args.append(b)
    ins.append(sp.seq_state())
    args.append(h0)
    outs = [sp.tok(BV, vblock=True), sp.seq_state()]
    sds = functools.partial(struct, like=args)  # shard_map: vary as the inputs do
    shapes = [sds((S, R, H, C, V), q.dtype), sds((N, H, K, V), F32)]
    if states:
        outs.append(sp.slot_state())
        shapes.append(sds((S, R, H, K, V), state_dtype(q.dtype)))
    grid = (R, H, V // BV, S)
    kern = functools.partial(pk.forward_kernel, has_b=has_b, states=states, scale=scale,
                             scalar=_scalar(a, b))
    return _call("gla_forward", kern, grid, ins, outs, tabs.slots, args,
                 shapes, [pltpu.VMEM((K, BV), F32)], interpret,
                 _cost("forward", grid, K, BV, has_b, _scalar(a, b), args, shapes))


def _backward(cfg, tabs, q, k, v, a, b, h0, hs, do, dfin):
    G, scale, interpret = cfg
    S, R, H, C, K = q.shape
    V, N, Hk = v.shape[-1], h0.shape[0], k.shape[2]
    BV, has_b, A = value_block(V), b is not None, a.shape[-1]
    nV, scalar = V // BV, _scalar(a, b)
    grid = (R, H, nV, S)

    rv = _Specs(S, R, G, K, BV, rev=True)
    ins, args = [rv.tok(K), rv.tok(A)], [q, a]
    if has_b:
        ins.append(rv.tok(BV, vblock=True))
        args.append(b)
    ins += [rv.tok(BV, vblock=True), rv.seq_state()]
    args += [do, dfin]
    sds = functools.partial(struct, like=(q, k, v, a, b, h0, hs, do, dfin))
    shapes = [sds((S, R, H, K, V), state_dtype(q.dtype)), sds((N, H, K, V), F32)]
    dh, dh0 = _call("gla_state_grad",
                    functools.partial(pk.state_grad_kernel, has_b=has_b, scale=scale,
                                      scalar=scalar), grid,
                    ins, [rv.slot_state(), rv.seq_state()], tabs.slots, args,
                    shapes, [pltpu.VMEM((K, BV), F32)], interpret,
                    _cost("state_grad", grid, K, BV, has_b, scalar, args, shapes))

    sp = _Specs(S, R, G, K, BV)
    ins = [sp.tok(K), sp.tok(K, kv=True), sp.tok(BV, kv=True, vblock=True), sp.tok(A)]
    args = [q, k, v, a]
    if has_b:
        ins.append(sp.tok(BV, vblock=True))
        args.append(b)
    ins += [sp.tok(BV, vblock=True), sp.slot_state(), sp.slot_state()]
    args += [do, hs, dh]
    # gradients leave in the input dtype unless value blocks or grouped heads add up
    part = lambda w, dt: sds((nV, S, R, H, C, w), dt if nV == 1 else F32)
    kvdt = lambda x: x.dtype if G == 1 else F32
    outs = [sp.part(K), sp.part(K), sp.part(A), sp.tok(BV, vblock=True)]
    shapes = [part(K, q.dtype), part(K, kvdt(k)), part(A, F32),
              sds((S, R, H, C, V), kvdt(v))]
    if has_b:
        outs.append(sp.tok(BV, vblock=True))
        shapes.append(sds((S, R, H, C, V), F32))
    res = _call("gla_chunk_grad",
                functools.partial(pk.chunk_grad_kernel, has_b=has_b, scale=scale,
                                  scalar=scalar), grid,
                ins, outs, tabs.slots, args, shapes, [], interpret,
                _cost("chunk_grad", grid, K, BV, has_b, scalar, args, shapes))
    dq, dk, da = (x[0] if nV == 1 else x.sum(0) for x in res[:3])
    dv = res[3]
    db = res[4] if has_b else None
    if G > 1:  # query heads of one kv group share k and v
        dk = dk.reshape(S, R, Hk, G, C, K).sum(3)
        dv = dv.reshape(S, R, Hk, G, C, V).sum(3)
    return dq, dk, dv, da, db, dh0


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _core(cfg, tabs, q, k, v, a, b, h0):
    """Chunked inputs (see Layout) -> (o [S,R,H,C,V] in q's dtype, final state [N,H,K,V]).
    cfg = (query heads per kv head, softmax scale, interpret)."""
    o, fin = _forward(cfg, tabs, q, k, v, a, b, h0)
    return o, _keep_empty(tabs, h0, fin)


def _keep_empty(tabs, h0, fin):
    empty = tabs.empty[:, None, None, None] != 0  # zero-length sequences keep their state
    return jnp.where(empty, h0, fin)


def _core_fwd(cfg, tabs, q, k, v, a, b, h0):
    o, fin, hs = _forward(cfg, tabs, q, k, v, a, b, h0, states=True)
    return (o, _keep_empty(tabs, h0, fin)), (tabs, q, k, v, a, b, h0, hs)


def _core_bwd(cfg, res, cts):
    tabs, q, k, v, a, b, h0, hs = res
    do, dfin = cts
    dq, dk, dv, da, db, dh0 = _backward(cfg, tabs, q, k, v, a, b, h0, hs, do, dfin)
    empty = tabs.empty[:, None, None, None] != 0
    dh0 = jnp.where(empty, dfin, dh0)
    dq, dk, dv = dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
    return (Tables(*(None for _ in tabs)), dq, dk, dv, da, db, dh0)


_core.defvjp(_core_fwd, _core_bwd)


class Tables(NamedTuple):
    """int32 scalar tables, flat over (slot, row): first (a sequence starts in this
    chunk), seq (its sequence), last (it ends in this chunk); per sequence: empty."""

    first: jax.Array
    seq: jax.Array
    last: jax.Array
    empty: jax.Array

    @property
    def slots(self):
        """The three per-slot tables the kernels scalar-prefetch."""
        return (self.first, self.seq, self.last)


def _tables(lay, N) -> Tables:
    S, R = lay.S, lay.R
    first = jnp.broadcast_to(lay.first, (S, R))
    seq = jnp.broadcast_to(lay.seq, (S, R)).astype(jnp.int32)
    nxt_first = jnp.concatenate([first[1:], jnp.ones((1, R), bool)])
    nxt_seq = jnp.concatenate([seq[1:], jnp.full((1, R), -1, jnp.int32)])
    last = nxt_first | (nxt_seq != seq)
    empty = jnp.zeros((N,), bool) if lay.empty is None else lay.empty
    flat = lambda x: x.astype(jnp.int32).reshape(-1)
    return Tables(flat(first), flat(seq), flat(last), flat(empty))


def recurrent_pallas(plan, q, k, v, g=None, gk=None, gv=None, g_gamma=None, initial_state=None,
                     cu_seqlens=None, interpret=None):
    """SPEC.md's recurrence with Pallas kernels; same convention as `recurrent_xla`.

    plan: `bridge.contract.check`'s Plan. q [B,T,H,K], k [B,T,Hk,K], v [B,T,Hk,V],
    g [B,T,H] or [B,T,H,K], gk [B,T,H,K], gv [B,T,H,V], g_gamma [H] or [N,H],
    initial_state [N,H,K,V], cu_seqlens [N+1] (B == 1, may be traced).
    interpret: None = Mosaic when lowered for a TPU, the interpreter elsewhere
    (decided per platform at lowering: `jax.export(..., platforms=["tpu"])` on any
    host gives the TPU kernels); True, False or a `pltpu.InterpretParams`.
    Returns o [B,T,H,V] in q's dtype and the float32 final state [N,H,K,V].
    """
    H, K, V, N, C = plan.H, plan.K, plan.V, plan.N, CHUNK
    lay = Layout(plan, cu_seqlens, C)
    f = lambda x: jnp.asarray(x).astype(F32)
    low = lambda x: jnp.asarray(x) if jnp.asarray(x).dtype in (jnp.bfloat16, jnp.float16) else f(x)

    qc, kc, vc = (lay.chunks(low(x)) for x in (q, k, v))
    a = lay.key_decay(plan, g, gk, g_gamma, F32)  # [S,R,H,C,K or 1]
    if a is None:
        a = jnp.zeros((lay.S, lay.R, H, C, 1), F32)
    if plan.gv or a.shape[-1] != 1:  # key-wise decays ([C, 1] stays: the scalar kernels)
        a = jnp.broadcast_to(a, (lay.S, lay.R, H, C, K))
    b = lay.chunks(f(gv)) if plan.gv else None
    # gates below -RESET_FLOOR are resets (exp = 0, gradient 0 through the clamp)
    a, b = (None if x is None else jnp.maximum(x, -RESET_FLOOR) for x in (a, b))
    h0 = f(initial_state) if plan.initial_state else jnp.zeros((N, H, K, V), F32)

    qc, kc, vc, a, b, h0 = vary_all(qc, kc, vc, a, b, h0)  # shard_map: one vma for all
    o, fin = _core((plan.group, float(plan.scale), interpret), _tables(lay, N),
                   qc, kc, vc, a, b, h0)
    return lay.tokens(o).astype(q.dtype), fin
