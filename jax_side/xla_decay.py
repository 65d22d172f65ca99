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


def _in_block(m, b):
    """Sums of gates b [X, 16, D] over the 0/1 rows of m [16, 16]: [X, 16, D].
    Broadcast over the blocks as a batched dot: XLA CPU's cumulative sums
    (reduce-window) cost more, unrolled running sums cost compile time, and
    contracting b's time axis directly makes XLA transpose b to time-minor and back
    (figures: BENCHMARKS.md, "Tuning history of the CPU paths")."""
    return jnp.einsum("xts,xsd->xtd", jnp.broadcast_to(jnp.asarray(m, b.dtype),
                                                       (b.shape[0], SUB, SUB)), b)


def _mid_matrix(h):
    """[16, 16] 0/1 rows for half-width h < 16: a row t in the right half of its aligned
    2h-segment sums the midpoint through t, one in the left half after t to the midpoint."""
    t, s = np.arange(SUB)[:, None], np.arange(SUB)[None, :]
    mid = t - t % (2 * h) + h
    return np.where(t >= mid, (s >= mid) & (s <= t), (s > t) & (s < mid)).astype(np.float64)


class Sums(NamedTuple):
    """In-block sums of log gates a [Z, C, D] (`local`): alpha from the 16-block's start
    through t, beta from after t to the block's end, tau [Z, C/16, D] block totals, and
    the gates a themselves (clamped) for `mid`."""
    alpha: jax.Array
    beta: jax.Array
    tau: jax.Array
    a: jax.Array

    def map(self, f):
        """The same sums with f applied to every array (a relayout)."""
        return Sums(*map(f, self))

    def mid(self, h):
        """[Z, C, D] for half-width h < 16: from the midpoint of t's aligned 2h-segment
        through t (right half), or from after t to that midpoint (left half)."""
        Z, C, D = self.a.shape
        return _in_block(_mid_matrix(h), self.a.reshape(-1, SUB, D)).reshape(Z, C, D)


def local(a):
    """In-block sums of log gates a [Z, C, D] (see Sums), each a sum of the gates it
    spans (matmuls of 0/1 rows), never a difference of two sums: with a gate far
    below zero in a block, a difference would cancel its magnitude and keep only
    |gate| * eps of the rest. Gates below -RESET_FLOOR count as that (bridge.decay)."""
    Z, C, D = a.shape
    a = jnp.maximum(a, -RESET_FLOOR)
    b = a.reshape(-1, SUB, D)
    ones = np.ones((SUB, SUB))
    alpha = _in_block(np.tril(ones), b)
    beta = _in_block(np.triu(ones, 1), b)
    return Sums(alpha.reshape(Z, C, D), beta.reshape(Z, C, D),
                alpha[:, -1].reshape(Z, C // SUB, D), a)


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
        m = seg(ka.mid(h))
        return m[:, :, 1], m[:, :, 0]
    into, out = spans(ka, h)
    return seg(into)[:, :, 1], seg(out)[:, :, 0]


def rowdot(x, y):
    """sum(x * y, -1) with broadcasting, as a matrix-vector product: XLA CPU runs
    minor-dim reductions slower than this dot."""
    return (x * y) @ jnp.ones((x.shape[-1],), x.dtype)
