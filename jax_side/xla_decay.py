"""Log-decay sums for the chunked XLA path, all built from short in-block sums.

Every exponent handed out here is a sum of gates over a span of the chunk
(<= 0 for gates <= 0, so strong gates cannot overflow), assembled from 16-token
in-block sums plus whole-block totals, none a difference of two sums: a gate
far below zero cannot take the other gates' precision with it.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from bridge.decay import RESET_FLOOR

SUB = 16  # sub-chunk width: the span of in-block cumulative log-gate sums


class Sums(NamedTuple):
    """In-block sums of log gates over [Z, C, D] (`local`): alpha from the 16-block's
    start through t, beta from after t to the block's end, tau [Z, C/16, D] block totals,
    and mids[l] (half-width h = 2^l < 16) from the midpoint of t's aligned 2h-segment
    through t (right half) or from after t to that midpoint (left half)."""
    alpha: jax.Array
    beta: jax.Array
    tau: jax.Array
    mids: tuple

    def map(self, f):
        """The same sums with f applied to every array (a relayout)."""
        return Sums(f(self.alpha), f(self.beta), f(self.tau), tuple(map(f, self.mids)))


def _matrices():
    """The 0/1 matrices [16, 16] of local's sums (row t sums the gates of its columns):
    alpha's, beta's and mids' (h = 1, 2, 4, 8) stacked [6 * 16, 16]."""
    t, s = np.arange(SUB)[:, None], np.arange(SUB)[None, :]
    mats = [s <= t, s > t]
    for h in (1, 2, 4, 8):
        mid = t - t % (2 * h) + h
        mats.append(np.where(t >= mid, (s >= mid) & (s <= t), (s > t) & (s < mid)))
    return np.concatenate(mats).astype(np.float64)


_MATS = _matrices()


def local(a):
    """In-block sums of log gates a [Z, C, D] (see Sums), each a sum of the gates it
    spans (one matmul of 0/1 rows), never a difference of two sums: with a gate far
    below zero in a block, a difference would cancel its magnitude and keep only
    |gate| * eps of the rest. Gates below -RESET_FLOOR count as that (bridge.decay)."""
    Z, C, D = a.shape
    X = Z * C // SUB
    a = jnp.maximum(a, -RESET_FLOOR)
    b = a.reshape(X, SUB, D)
    # triangular matmuls, broadcast over the blocks as a batched dot: XLA CPU's cumulative
    # sums (reduce-window) cost more, unrolled running sums cost compile time, and
    # contracting b's time axis directly makes XLA transpose b to time-minor and back
    # (figures: BENCHMARKS.md, "Tuning history of the CPU paths")
    m = jnp.broadcast_to(jnp.asarray(_MATS, a.dtype), (X, *_MATS.shape))
    sums = jnp.einsum("xts,xsd->xtd", m, b).reshape(X, -1, SUB, D)
    per = [sums[:, i].reshape(Z, C, D) for i in range(sums.shape[1])]
    tau = sums[:, 0, -1].reshape(Z, C // SUB, D)
    return Sums(per[0], per[1], tau, tuple(per[2:]))


def _blocks_around(tau, w):
    """Whole 16-blocks of t's aligned w-segment before t's block and after it, both
    [Z, C/16, 1, D] for block totals tau [Z, C/16, D]: sums of gates, <= 0."""
    Z, nc, D = tau.shape
    t = tau.reshape(Z, nc * SUB // w, w // SUB, D)
    zero = jnp.zeros_like(t[:, :, :1])
    before = lax.cumsum(jnp.concatenate([zero, t[:, :, :-1]], 2), axis=2)
    after = lax.cumsum(jnp.concatenate([t[:, :, 1:], zero], 2), axis=2, reverse=True)
    return before.reshape(Z, nc, 1, D), after.reshape(Z, nc, 1, D)


def spans(ka, w):
    """Log decay from the start of t's aligned w-segment through t (into), and from
    after t to that segment's end (out), both [Z, C, D], w a multiple of 16:
    in-block sums plus whole 16-blocks, all terms <= 0 for gates <= 0."""
    Z, C, D = ka.alpha.shape
    before, after = _blocks_around(ka.tau, w)
    into = ka.alpha.reshape(Z, C // SUB, SUB, D) + before
    out = ka.beta.reshape(Z, C // SUB, SUB, D) + after
    return into.reshape(Z, C, D), out.reshape(Z, C, D)


def level(ka, h):
    """Exponents for the cross block of every 2h-segment at half-width h: the right
    half from its start through t [Z, C/2h, h, D] and the left half from after s
    to its end [Z, C/2h, h, D], referenced at the midpoint, so both are <= 0."""
    Z, C, D = ka.alpha.shape
    seg = lambda x: x.reshape(Z, C // (2 * h), 2, h, D)  # noqa: E731
    if h < SUB:  # inside one 16-block: its own sums
        m = seg(ka.mids[h.bit_length() - 1])
        return m[:, :, 1], m[:, :, 0]
    into, out = spans(ka, h)
    return seg(into)[:, :, 1], seg(out)[:, :, 0]


def rowdot(x, y):
    """sum(x * y, -1) with broadcasting, as a matrix-vector product: XLA CPU runs
    minor-dim reductions slower than this dot."""
    return (x * y) @ jnp.ones((x.shape[-1],), x.dtype)
