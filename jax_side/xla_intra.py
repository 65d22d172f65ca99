"""In-chunk causal attention for key-dim gates, with a hand-written backward.

    o_t = sum_{s<=t} P_ts v_s,   P_ts = sum_d q_td k_sd exp(A_td - A_sd)

for chunks q, k [Z, C, K], v [Z, C, V] and per-token log gates a [Z, C, K]
(A the in-chunk running sum of a). P is assembled by a binary tree over the
chunk: the block of each 2h-segment's right half against its left half
factors through the segment midpoint (both exponents <= 0), so no pairwise
exponentials are needed and strong gates stay at scan-level precision.

JAX autodiff of the tree kept every level's scaled operands and ran slow
minor-dim reductions; the backward here walks the same tree once more:
dP = do v^T, each level's cross block of dP gives dq, dk and, summed within
the half-segments, the gate gradient of the pairs spanning that level.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .xla_decay import SUB, level, local, rowdot, spans


# Largest in-chunk |log decay| the chunk-start reference of `block_p` may carry: its key
# factors are e^{-A} <= e^30, and a sum of that size costs ~30 eps in the differences it
# stands for (the tree is exact in that sense, and the fallback).
LIMIT = 30.0


def tree_p(q, k, ka, scales=None):
    """The lower-triangular in-chunk weights P [Z, C, C] (diagonal included);
    ka = local(a) for the key-side gates a [Z, C, K]. `scales`, a list, collects
    each level's factors (e^eq [Z,C/2h,h,K], e^ek [Z,C/2h,h,K]) for the backward."""
    Z, C, K = q.shape
    p = rowdot(q, k)[:, :, None, None]  # assembled blocks [Z, C/2h, 2h, 2h]
    h = 1
    while h < C:
        n = C // (2 * h)
        seg = lambda x: x.reshape(Z, n, 2, h, x.shape[-1])
        e_q, e_k = (jnp.exp(e) for e in level(ka, h))
        if scales is not None:
            scales.append((e_q, e_k))
        qf, kf = seg(q)[:, :, 1] * e_q, seg(k)[:, :, 0] * e_k
        # every level a batched dot, the narrow ones too (unrolled narrow products were
        # slower: BENCHMARKS.md, "Tuning history of the CPU paths")
        cross = jnp.einsum("znik,znjk->znij", qf, kf)
        ch = p.reshape(Z, n, 2, h, h)
        p = jnp.concatenate([jnp.concatenate([ch[:, :, 0], jnp.zeros_like(cross)], -1),
                             jnp.concatenate([cross, ch[:, :, 1]], -1)], -2)
        h *= 2
    return p.reshape(Z, C, C)


def block_p(q, k, ka, e_in=None):
    """The same P [Z, C, C] as `tree_p` as one matmul (no backward; for chunks whose log
    decays from the chunk start through t, A_t, are all within LIMIT): P_ts =
    (q_t e^{A_t}) . (k_s e^{-A_s}) for s <= t, the factors in [e^-LIMIT, e^LIMIT].
    e_in: e^{A} [Z, C, K] if the caller has it."""
    e_in = jnp.exp(spans(ka, q.shape[1])[0]) if e_in is None else e_in
    return _start_p(q * e_in, k / e_in)


def _start_p(qe, ke):
    """tril(qe ke^T) [Z, C, C] for qe = q e^{A}, ke = k e^{-A}."""
    C = qe.shape[1]
    p = jnp.einsum("ztk,zsk->zts", qe, ke)
    return jnp.where(np.tril(np.ones((C, C), bool)), p, 0)


def forward_p(q, k, ka, into=None, load=None):
    """P [Z, C, C] for a forward without a backward: `block_p` when every |A_t| (the log
    decay from the chunk start through t) is within LIMIT, else the tree. into: A
    [Z, C, K] (xla_decay.spans of ka over the chunk) if the caller has it. load: a
    function giving the same (q, k, ka), called inside the tree's branch only (XLA makes
    a branch's operands on every call, taken or not), if the caller has one."""
    C = q.shape[1]
    if C < SUB:
        return tree_p(q, k, ka)
    into = spans(ka, C)[0] if into is None else into
    mild = jnp.max(jnp.abs(into)) <= LIMIT
    e_in = jnp.exp(into)  # (q e^{A}: the callers' inter-chunk queries too)
    load = (lambda: (q, k, ka)) if load is None else load
    return lax.cond(mild, _start_p, lambda qe, ke: tree_p(*load()), q * e_in, k / e_in)


@jax.custom_vjp
def key_intra(q, k, v, a):
    """In-chunk output [Z, C, V] for q, k [Z,C,K], v [Z,C,V], a [Z,C,K]."""
    return forward_p(q, k, local(a)) @ v


def _fwd(q, k, v, a):
    # the level factors are kept (one [Z,C,K] array a level): recomputing them
    # costs an exp pass a level plus the in-block sums
    scales = []
    p = tree_p(q, k, local(a), scales)
    return p @ v, (q, k, v, p, scales)


def _bwd(res, do):
    q, k, v, p, scales = res
    Z, C, K = q.shape
    dv = jnp.einsum("zts,ztv->zsv", p, do)
    dp = jnp.einsum("ztv,zsv->zts", do, v) * jnp.asarray(np.tril(np.ones((C, C))), q.dtype)
    dq, dk = [], []  # per-level contributions, summed once at the end
    da = []
    blocks, h = dp[:, None], C // 2  # top-down: the diagonal 2h-blocks [Z, C/2h, 2h, 2h]
    level = len(scales)
    while h >= 1:
        level -= 1
        n = C // (2 * h)
        seg = lambda x: x.reshape(Z, n, 2, h, x.shape[-1])
        blk = blocks[:, :, h:, :h]  # rows: right half, columns: left half
        e_q, e_k = scales[level]
        qf, kf = seg(q)[:, :, 1] * e_q, seg(k)[:, :, 0] * e_k
        dqf = jnp.einsum("znij,znjk->znik", blk, kf)
        dkf = jnp.einsum("znij,znik->znjk", blk, qf)
        # gate gradient from this level's pairs (s left of the midpoint, t right):
        # the pair's exponent sums a_u over s < u <= t, so a_u in the right half
        # collects the pairs with t >= u, one in the left half those with s < u;
        # only midpoint-spanning terms enter (q.dq - k.dk over the whole chunk
        # cancels O(1) terms down to strong gates' tiny gradients)
        zero = jnp.zeros_like(dqf)
        da.append(jnp.stack([_scan_half(kf * dkf, False), _scan_half(qf * dqf, True)],
                            2).reshape(Z, C, K))
        dq.append(jnp.stack([zero, dqf * e_q], 2).reshape(Z, C, K))
        dk.append(jnp.stack([dkf * e_k, zero], 2).reshape(Z, C, K))
        blocks = jnp.stack([blocks[:, :, :h, :h], blocks[:, :, h:, h:]], 2)
        blocks = blocks.reshape(Z, 2 * n, h, h)
        h //= 2
    dd = blocks.reshape(Z, C, 1)  # the diagonal, P_tt = q_t . k_t
    dq.append(dd * k)
    dk.append(dd * q)
    return sum(dq), sum(dk), dv, sum(da)


def _scan_half(x, reverse):
    """Cumulative sum over axis 2 of x [Z, n, h, K]: inclusive from the end
    (reverse) or exclusive from the start; 16-blocks plus block offsets, as
    XLA CPU's cumulative sums cost O(h) a element."""
    Z, n, h, K = x.shape
    if not reverse:  # exclusive: shift by one
        x = jnp.concatenate([jnp.zeros_like(x[:, :, :1]), x[:, :, :-1]], 2)
    if h <= SUB:
        return lax.cumsum(x, axis=2, reverse=reverse)
    b = x.reshape(Z, n, h // SUB, SUB, K)
    inner = lax.cumsum(b, axis=3, reverse=reverse)
    tot = inner[:, :, :, 0] if reverse else inner[:, :, :, -1]
    off = lax.cumsum(tot, axis=2, reverse=reverse) - tot  # the blocks before (after)
    return (inner + off[:, :, :, None]).reshape(Z, n, h, K)


key_intra.defvjp(_fwd, _bwd)
