"""Log-decay sums for the chunked XLA path, all built from short in-block sums.

Every exponent handed out here is a sum of gates over a span of the chunk
(<= 0 for gates <= 0, so strong gates cannot overflow), assembled from 16-token
in-block cumulative sums plus whole-block totals: no long running sums are
subtracted, which keeps strong gates at scan-level precision.
"""

import jax.numpy as jnp
import numpy as np
from jax import lax

SUB = 16  # sub-chunk width: the span of in-block cumulative log-gate sums


def local(a):
    """In-block sums of log gates, a [Z, C, D] -> (alpha, beta, tau): alpha [Z,C,D]
    from the 16-block's start through t, beta [Z,C,D] from after t to the block's
    end (its own suffix scan, so nothing cancels), tau [Z, C/16, D] block totals."""
    Z, C, D = a.shape
    X = Z * C // SUB
    b = a.reshape(X, SUB, D)
    # triangular matmuls, broadcast over the blocks as a batched dot: XLA CPU's cumulative
    # sums (reduce-window) cost more, unrolled running sums cost compile time, and
    # contracting b's time axis directly makes XLA transpose b to time-minor and back
    # (figures: BENCHMARKS.md, "Tuning history of the CPU paths")
    ones = np.ones((SUB, SUB))
    tri = lambda m: jnp.broadcast_to(jnp.asarray(m, a.dtype), (X, SUB, SUB))  # noqa: E731
    alpha = jnp.einsum("xts,xsd->xtd", tri(np.tril(ones)), b).reshape(Z, C // SUB, SUB, D)
    beta = jnp.einsum("xts,xsd->xtd", tri(np.triu(ones, 1)), b)
    return alpha.reshape(Z, C, D), beta.reshape(Z, C, D), alpha[:, :, -1]


def _blocks_around(tau, w):
    """Whole 16-blocks of t's aligned w-segment before t's block and after it, both
    [Z, C/16, 1, D] for block totals tau [Z, C/16, D]: sums of gates, <= 0."""
    Z, nc, D = tau.shape
    t = tau.reshape(Z, nc * SUB // w, w // SUB, D)
    zero = jnp.zeros_like(t[:, :, :1])
    before = lax.cumsum(jnp.concatenate([zero, t[:, :, :-1]], 2), axis=2)
    after = lax.cumsum(jnp.concatenate([t[:, :, 1:], zero], 2), axis=2, reverse=True)
    return before.reshape(Z, nc, 1, D), after.reshape(Z, nc, 1, D)


def spans(alpha, beta, tau, w):
    """Log decay from the start of t's aligned w-segment through t (into), and from
    after t to that segment's end (out), both [Z, C, D], w a multiple of 16:
    in-block sums plus whole 16-blocks, all terms <= 0 for gates <= 0."""
    Z, C, D = alpha.shape
    before, after = _blocks_around(tau, w)
    into = alpha.reshape(Z, C // SUB, SUB, D) + before
    out = beta.reshape(Z, C // SUB, SUB, D) + after
    return into.reshape(Z, C, D), out.reshape(Z, C, D)


def level(alpha, beta, tau, h):
    """Exponents for the cross block of every 2h-segment at half-width h: the right
    half from its start through t [Z, C/2h, h, D] and the left half from after s
    to its end [Z, C/2h, h, D], referenced at the midpoint, so both are <= 0."""
    Z, C, D = alpha.shape
    seg = lambda x: x.reshape(Z, C // (2 * h), 2, h, D)
    if h < SUB:  # inside one 16-block: differences of its short in-block sums
        al = seg(alpha)
        mid = al[:, :, 0, -1:]
        return al[:, :, 1] - mid, mid - al[:, :, 0]
    into, out = spans(alpha, beta, tau, h)
    return seg(into)[:, :, 1], seg(out)[:, :, 0]


def rowdot(x, y):
    """sum(x * y, -1) with broadcasting, as a matrix-vector product: XLA CPU runs
    minor-dim reductions slower than this dot."""
    return (x * y) @ jnp.ones((x.shape[-1],), x.dtype)
