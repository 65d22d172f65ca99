"""Gated linear attention as Pallas TPU kernels (platform="pallas").

Tokens go into chunk slots [S, R, H, C, D] with the XLA path's layout (flip for
reverse, a gather table for traced cu_seqlens); K and V are padded to the
(8, 128) tiling on the host and cropped after. Three kernels, each with grid
(row, head, value block, slot), the slot axis sequential and scalar-prefetched
tables (first chunk / sequence / last chunk of each slot) steering the
initial and final states of varlen sequences:

  forward      chunk outputs, fp32 state carried in VMEM (optionally every
               chunk's entering state: the backward's recomputation)
  state grad   the reverse pass over slots for the state gradient
  chunk grad   dq, dk, dv and the gate gradients, chunk-local

The host code around `_core` (layout, gate sums, casts) is jnp, differentiated
by JAX; `_core` is a custom_vjp whose rules launch only the kernels.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .pallas_kernels import chunk_grad_kernel, forward_kernel, state_grad_kernel
from .xla import _Layout

CHUNK = 16  # tokens per chunk: also the longest span of a running log-gate sum
LANE = 128
F32 = jnp.float32


def _pad_to(x, axis, m):
    n = x.shape[axis]
    p = -n % m
    if p == 0:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, p)
    return jnp.pad(x, pad)


class _Specs:
    """BlockSpecs for the grid (R, H, nV, S); `rev` visits slots last to first."""

    def __init__(self, S, R, G, C, Kp, BV, rev=False):
        self.S, self.R, self.G, self.C, self.Kp, self.BV, self.rev = S, R, G, C, Kp, BV, rev

    def _s(self, s):
        return self.S - 1 - s if self.rev else s

    def tok(self, width, kv=False, vblock=False):
        """A chunk of a [S, R, H(k), C, D] array."""
        sq = pl.Squeezed()
        G = self.G

        def index(r, h, vb, s, *_):
            # lax.div: jnp's floor division lowers through `sign`, which needs a TPU present
            return (self._s(s), r, lax.div(h, G) if kv and G > 1 else h, 0, vb if vblock else 0)

        return pl.BlockSpec((sq, sq, sq, self.C, width), index)

    def part(self):
        """A chunk of a [nV, S, R, H, C, Kp] per-value-block partial sum."""
        sq = pl.Squeezed()
        return pl.BlockSpec((sq, sq, sq, sq, self.C, self.Kp),
                            lambda r, h, vb, s, *_: (vb, self._s(s), r, h, 0, 0))

    def seq_state(self):
        """A [Kp, BV] block of a [N, H, Kp, Vp] array, picked by the slot's sequence."""
        sq = pl.Squeezed()

        def index(r, h, vb, s, first, seq, last):
            return (seq[self._s(s) * self.R + r], h, 0, vb)

        return pl.BlockSpec((sq, sq, self.Kp, self.BV), index)

    def slot_state(self):
        """A [Kp, BV] block of a [S, R, H, Kp, Vp] array of per-slot states."""
        sq = pl.Squeezed()
        return pl.BlockSpec((sq, sq, sq, self.Kp, self.BV),
                            lambda r, h, vb, s, *_: (self._s(s), r, h, 0, vb))


def _call(kernel, grid, in_specs, out_specs, out_shape, scratch, interpret):
    params = {}
    if interpret is False:
        params["compiler_params"] = pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"))
    gs = pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=3, grid=grid, in_specs=in_specs,
                                      out_specs=out_specs, scratch_shapes=scratch)
    return pl.pallas_call(kernel, grid_spec=gs, out_shape=out_shape,
                          interpret=interpret, **params)


def _forward(cfg, tabs, q, k, v, a, b, h0, states=False):
    G, interpret = cfg
    S, R, H, C, Kp = q.shape
    Vp, N = v.shape[-1], h0.shape[0]
    BV = LANE
    sp = _Specs(S, R, G, C, Kp, BV)
    has_b = b is not None
    ins = [sp.tok(Kp), sp.tok(Kp, kv=True), sp.tok(BV, kv=True, vblock=True), sp.tok(Kp)]
    args = [q, k, v, a]
    if has_b:
        ins.append(sp.tok(BV, vblock=True))
        args.append(b)
    ins.append(sp.seq_state())
    args.append(h0)
    outs = [sp.tok(BV, vblock=True), sp.seq_state()]
    shapes = [jax.ShapeDtypeStruct((S, R, H, C, Vp), F32), jax.ShapeDtypeStruct((N, H, Kp, Vp), F32)]
    if states:
        outs.append(sp.slot_state())
        shapes.append(jax.ShapeDtypeStruct((S, R, H, Kp, Vp), F32))
    kern = functools.partial(forward_kernel, has_b=has_b, states=states)
    return _call(kern, (R, H, Vp // BV, S), ins, outs, shapes,
                 [pltpu.VMEM((Kp, BV), F32)], interpret)(*tabs[:3], *args)


def _backward(cfg, tabs, q, k, v, a, b, h0, do, dfin):
    G, interpret = cfg
    S, R, H, C, Kp = q.shape
    Vp, N, Hk = v.shape[-1], h0.shape[0], k.shape[2]
    BV, nV, has_b = LANE, v.shape[-1] // LANE, b is not None
    grid = (R, H, nV, S)
    _, _, hs = _forward(cfg, tabs, q, k, v, a, b, h0, states=True)

    rv = _Specs(S, R, G, C, Kp, BV, rev=True)
    ins, args = [rv.tok(Kp), rv.tok(Kp)], [q, a]
    if has_b:
        ins.append(rv.tok(BV, vblock=True))
        args.append(b)
    ins += [rv.tok(BV, vblock=True), rv.seq_state()]
    args += [do, dfin]
    dh, dh0 = _call(functools.partial(state_grad_kernel, has_b=has_b), grid, ins,
                    [rv.slot_state(), rv.seq_state()],
                    [jax.ShapeDtypeStruct((S, R, H, Kp, Vp), F32),
                     jax.ShapeDtypeStruct((N, H, Kp, Vp), F32)],
                    [pltpu.VMEM((Kp, BV), F32)], interpret)(*tabs[:3], *args)

    sp = _Specs(S, R, G, C, Kp, BV)
    ins = [sp.tok(Kp), sp.tok(Kp, kv=True), sp.tok(BV, kv=True, vblock=True), sp.tok(Kp)]
    args = [q, k, v, a]
    if has_b:
        ins.append(sp.tok(BV, vblock=True))
        args.append(b)
    ins += [sp.tok(BV, vblock=True), sp.slot_state(), sp.slot_state()]
    args += [do, hs, dh]
    part = jax.ShapeDtypeStruct((nV, S, R, H, C, Kp), F32)
    tokv = jax.ShapeDtypeStruct((S, R, H, C, Vp), F32)
    outs = [sp.part(), sp.part(), sp.part(), sp.tok(BV, vblock=True)]
    shapes = [part, part, part, tokv]
    if has_b:
        outs.append(sp.tok(BV, vblock=True))
        shapes.append(tokv)
    res = _call(functools.partial(chunk_grad_kernel, has_b=has_b), grid, ins, outs, shapes,
                [], interpret)(*tabs[:3], *args)
    dq, dk, da = (x.sum(0) for x in res[:3])
    dv = res[3]
    db = res[4] if has_b else None
    if G > 1:  # query heads of one kv group share k and v
        dk = dk.reshape(S, R, Hk, G, C, Kp).sum(3)
        dv = dv.reshape(S, R, Hk, G, C, Vp).sum(3)
    return dq, dk, dv, da, db, dh0


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _core(cfg, tabs, q, k, v, a, b, h0):
    """Chunked inputs (see _Layout, padded) -> (o [S,R,H,C,Vp], final state [N,H,Kp,Vp])."""
    return _core_fwd(cfg, tabs, q, k, v, a, b, h0)[0]


def _core_fwd(cfg, tabs, q, k, v, a, b, h0):
    o, fin = _forward(cfg, tabs, q, k, v, a, b, h0)
    empty = tabs[3][:, None, None, None] != 0  # zero-length sequences keep their state
    fin = jnp.where(empty, h0, fin)
    return (o, fin), (tabs, q, k, v, a, b, h0)


def _core_bwd(cfg, res, cts):
    tabs, q, k, v, a, b, h0 = res
    do, dfin = cts
    dq, dk, dv, da, db, dh0 = _backward(cfg, tabs, q, k, v, a, b, h0, do, dfin)
    empty = tabs[3][:, None, None, None] != 0
    dh0 = jnp.where(empty, dfin, dh0)
    return (tuple(None for _ in tabs), dq, dk, dv, da, db, dh0)


_core.defvjp(_core_fwd, _core_bwd)


def _tables(lay, N):
    """int32 scalar tables, flat over (slot, row): first chunk, sequence, last chunk;
    and per sequence: empty."""
    S, R = lay.S, lay.R
    first = jnp.broadcast_to(lay.first, (S, R))
    seq = jnp.broadcast_to(lay.seq, (S, R)).astype(jnp.int32)
    nxt_first = jnp.concatenate([first[1:], jnp.ones((1, R), bool)])
    nxt_seq = jnp.concatenate([seq[1:], jnp.full((1, R), -1, jnp.int32)])
    last = nxt_first | (nxt_seq != seq)
    empty = jnp.zeros((N,), bool) if lay.empty is None else lay.empty
    flat = lambda x: x.astype(jnp.int32).reshape(-1)
    return flat(first), flat(seq), flat(last), flat(empty)


def recurrent_pallas(plan, q, k, v, g=None, gk=None, gv=None, g_gamma=None, initial_state=None,
                     cu_seqlens=None, interpret=None):
    """SPEC.md's recurrence with Pallas kernels; same convention as `recurrent_xla`.

    plan: `bridge.contract.check`'s Plan. q [B,T,H,K], k [B,T,Hk,K], v [B,T,Hk,V],
    g [B,T,H] or [B,T,H,K], gk [B,T,H,K], gv [B,T,H,V], g_gamma [H] or [N,H],
    initial_state [N,H,K,V], cu_seqlens [N+1] (B == 1, may be traced).
    interpret: None = interpret mode unless the default backend is a TPU; True,
    False or a `pltpu.InterpretParams`. Returns o [B,T,H,V] in q's dtype and the
    float32 final state [N,H,K,V].
    """
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    H, K, V, N, C = plan.H, plan.K, plan.V, plan.N, CHUNK
    lay = _Layout(plan, cu_seqlens, C)
    f = lambda x: jnp.asarray(x).astype(F32)
    padk = lambda x: _pad_to(x, -1, LANE)

    qc = padk(lay.chunks(f(q) * plan.scale))
    kc, vc = padk(lay.chunks(f(k))), padk(lay.chunks(f(v)))
    a = None  # key-side log decay [S,R,H,C,K or 1]
    if plan.g != "none":
        a = lay.chunks(f(g) if plan.g == "key" else f(g)[..., None])
    if plan.gk:
        a = lay.chunks(f(gk)) if a is None else a + lay.chunks(f(gk))
    if plan.g_gamma != "none":
        gam = f(g_gamma)
        gam = gam[lay.seq] if plan.g_gamma == "seq" else jnp.broadcast_to(gam, (lay.R, H))
        gam = gam[..., None, None] * lay.valid  # padding positions must not decay
        a = gam if a is None else a + gam
    if a is None:
        a = jnp.zeros((lay.S, lay.R, H, C, 1), F32)
    a = padk(jnp.broadcast_to(a, (lay.S, lay.R, H, C, K)))
    b = padk(lay.chunks(f(gv))) if plan.gv else None
    h0 = f(initial_state) if plan.initial_state else jnp.zeros((N, H, K, V), F32)
    h0 = _pad_to(_pad_to(h0, 2, LANE), 3, LANE)

    o, fin = _core((plan.group, interpret), _tables(lay, N), qc, kc, vc, a, b, h0)
    o = lay.tokens(o[..., :V]).astype(q.dtype)
    return o, fin[:, :, :K, :V]
