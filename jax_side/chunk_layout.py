"""The chunk layout both JAX chunked paths share (XLA and Pallas): tokens
[B, T, H, D] to chunk slots [S, R, H, C, D] and back, with the per-slot tables
(`valid`, `first`, `seq`, `last`, `empty`) that traced `cu_seqlens` need."""

import jax.numpy as jnp
import numpy as np

from bridge.decay import key_decay


class Layout:
    """Maps tokens [B, T, H, D] to chunk slots [S, R, H, C, D] and back.

    Batched (R = B rows, one sequence each, S = ceil(T/C) slots): pad + reshape,
    flipped in time for reverse. Varlen (R = 1): a gather through a table built
    from the (possibly traced) cu_seqlens with static size
    S = (L + N*(C-1)) // C >= sum_i ceil(len_i / C); a padding position reads
    an appended zero token. Also gives per slot: `valid` [S,R,1,C,1],
    `first` [S,R] (a sequence starts here), `seq` [S,R] (its sequence), and per
    sequence `last` = (slot, row) of its last chunk and `empty` (length 0).
    """

    def __init__(self, plan, cu_seqlens, C):
        self.C, self.varlen, self.reverse = C, plan.varlen, plan.reverse
        L, N = plan.T, plan.N
        if not plan.varlen:
            self.T, self.R, self.S = L, plan.B, max(1, -(-L // C))
            pos = np.arange(self.S * C).reshape(self.S, 1, 1, C, 1)
            self.valid = jnp.asarray(pos < L)
            self.seq = jnp.broadcast_to(jnp.arange(self.R, dtype=jnp.int32), (self.S, self.R))
            self.first = jnp.asarray(np.arange(self.S)[:, None] == 0)
            self.last = (jnp.full((N,), self.S - 1), jnp.arange(N))
            self.empty = None  # T == 0 leaves the state untouched anyway
            return
        self.T, self.R, self.S = L, 1, max(1, (L + N * (C - 1)) // C)
        cu = cu_seqlens.astype(jnp.int32)
        lens = cu[1:] - cu[:-1]
        ends = jnp.cumsum((lens + C - 1) // C)  # one past each sequence's last slot
        starts = ends - (lens + C - 1) // C
        slot = jnp.arange(self.S, dtype=jnp.int32)
        seq = jnp.searchsorted(ends, slot, side="right").astype(jnp.int32)
        used, seq = seq < N, jnp.minimum(seq, N - 1)
        j = slot - starts[seq]
        p = j[:, None] * C + jnp.arange(C, dtype=jnp.int32)  # position inside the sequence
        valid = used[:, None] & (p < lens[seq, None])
        tok = cu[seq, None] + (lens[seq, None] - 1 - p if plan.reverse else p)
        self.idx = jnp.where(valid, tok, L).reshape(-1)
        self.valid = valid.reshape(self.S, 1, 1, C, 1)
        self.seq, self.first = seq[:, None], (used & (j == 0))[:, None]
        self.last = (jnp.maximum(ends - 1, 0), jnp.zeros((N,), jnp.int32))
        self.empty = lens == 0
        # inverse map: token -> flat (slot, position) index
        t = jnp.arange(L, dtype=jnp.int32)
        n = jnp.searchsorted(cu[1:], t, side="right").astype(jnp.int32)
        p = (cu[n + 1] - 1 - t) if plan.reverse else (t - cu[n])
        self.inv = (starts[n] + p // C) * C + p % C

    def chunks(self, x):
        """[B, T, H, D] -> [S, R, H, C, D]."""
        S, C = self.S, self.C
        if self.varlen:
            x = jnp.concatenate([x[0], jnp.zeros((1, *x.shape[2:]), x.dtype)])
            x = jnp.take(x, self.idx, axis=0, mode="clip").reshape(S, C, 1, *x.shape[1:])
            return x.transpose(0, 2, 3, 1, 4)
        if self.reverse:
            x = jnp.flip(x, 1)
        x = jnp.pad(x, ((0, 0), (0, S * C - self.T), (0, 0), (0, 0)))
        return x.reshape(x.shape[0], S, C, *x.shape[2:]).transpose(1, 0, 3, 2, 4)

    def tokens(self, y):
        """[S, R, H, C, D] -> [B, T, H, D]."""
        S, R, H, C, D = y.shape
        if self.varlen:
            y = y.transpose(0, 1, 3, 2, 4).reshape(S * C, H, D)
            return jnp.take(y, self.inv, axis=0, mode="clip")[None]
        y = y.transpose(1, 0, 3, 2, 4).reshape(R, S * C, H, D)[:, :self.T]
        return jnp.flip(y, 1) if self.reverse else y

    def key_decay(self, plan, g, gk, g_gamma, dtype):
        """The key-side log decay per token in slots, a = g + gk + g_gamma, [S,R,H,C,K]
        (K = 1 with only per-head terms), in `dtype`; None without key-side gates.
        g_gamma is zero at padding positions, which must not decay."""
        f = lambda x: jnp.asarray(x).astype(dtype)  # noqa: E731
        a_g = a_gk = gam = None
        if plan.g != "none":
            a_g = self.chunks(f(g) if plan.g == "key" else f(g)[..., None])
        if plan.gk:
            a_gk = self.chunks(f(gk))
        if plan.g_gamma != "none":
            gam = f(g_gamma)
            gam = gam[self.seq] if plan.g_gamma == "seq" else jnp.broadcast_to(
                gam, (self.R, plan.H))
            gam = jnp.where(self.valid, gam[..., None, None], 0.0)  # (-inf * 0 is NaN)
        return key_decay(a_g, a_gk, gam)
