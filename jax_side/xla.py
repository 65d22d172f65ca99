"""Chunked gated linear attention in plain jax.numpy / lax (SPEC.md's recurrence).

Tokens are cut into chunks of `chunk_size` (a static chunk table that also
serves traced `cu_seqlens`): every chunk's own output and state update is
computed at once with batched matmuls, and only the cheap elementwise state
recurrence runs in a `lax.scan` over chunks. Log-decays are summed over
16-token sub-chunks and combined through reference points (sub-chunk and chunk
boundaries), so every exponent is <= 0 for gates <= 0 and precision stays at
step-by-step level; pairwise exp(A_t - A_s) is formed only inside the diagonal
16x16 blocks. Gradients are plain JAX autodiff (with `jax.checkpoint` around
the chunk work so the backward keeps only chunk-sized inputs and states).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

SUB = 16  # sub-chunk width: the span of in-block cumulative log-gate sums


class _Layout:
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
            x = jnp.concatenate([x[0], jnp.zeros_like(x[0, :1])])
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


def _decays(a, n):
    """Log-decay sums of one side (keys or values) relative to reference points.

    a [..., C, D] (D = K, V, or 1 for a scalar per head), C = n * SUB. Returns
    in_blk [..., n, SUB, D]: sum over (block start, t]; to_end [..., n, SUB, D]:
    sum over (t, block end]; pre/post [..., n, D]: whole blocks before/after;
    mid [..., n, n, D]: blocks strictly between i and j < i (-inf where j >= i);
    total [..., D]. All are sums of the gates themselves, never differences of
    long running sums, so nothing cancels and every term is <= 0 for gates <= 0.
    """
    a = a.reshape(*a.shape[:-2], n, SUB, a.shape[-1])
    in_blk = jnp.cumsum(a, axis=-2)
    suffix = jnp.flip(jnp.cumsum(jnp.flip(a, -2), axis=-2), -2)
    to_end = jnp.concatenate([suffix[..., 1:, :], jnp.zeros_like(suffix[..., :1, :])], -2)
    tot = [in_blk[..., i, -1, :] for i in range(n)]
    zero, ninf = jnp.zeros_like(tot[0]), jnp.full_like(tot[0], -jnp.inf)
    pre, post = [zero], [zero]
    for i in range(1, n):
        pre.append(pre[-1] + tot[i - 1])
        post.insert(0, post[0] + tot[n - i])
    mid = [[ninf] * n for _ in range(n)]
    for i in range(1, n):
        mid[i][i - 1] = zero
        for j in range(i - 2, -1, -1):
            mid[i][j] = mid[i][j + 1] + tot[j + 1]
    mid = jnp.stack([jnp.stack(r, -2) for r in mid], -3)
    return in_blk, to_end, jnp.stack(pre, -2), jnp.stack(post, -2), mid, pre[-1] + tot[-1]


def _pairwise(x, y, cum):
    """Diagonal-block weights: sum_d x[t,d] y[s,d] exp(cum[t,d] - cum[s,d]) for s <= t.

    x, y [..., SUB, Dx], cum [..., SUB, D] with D == Dx or 1 -> [..., SUB, SUB]."""
    causal = np.tril(np.ones((SUB, SUB), bool))[..., None]
    w = jnp.exp(jnp.where(causal, cum[..., :, None, :] - cum[..., None, :, :], -jnp.inf))
    if cum.shape[-1] == 1:
        return jnp.einsum("...td,...sd->...ts", x, y) * w[..., 0]
    return jnp.einsum("...td,...sd,...tsd->...ts", x, y, w)


def _chunk_terms(q, k, v, a, b):
    """Everything one chunk contributes, batched over leading dims.

    q, k [..., C, K], v [..., C, V] (q already scaled); a [..., C, K or 1] and
    b [..., C, V] or None: log decays. Returns the intra-chunk output
    [..., C, V], q_in [..., C, K] and out_v [..., C, V] (o_inter =
    (q_in @ S_in) * out_v), the chunk update U [..., K, V] and the chunk's
    total decays dA [..., K or 1], dB [..., V] or None.
    """
    C = q.shape[-2]
    n = C // SUB
    blk = lambda x: x.reshape(*x.shape[:-2], n, SUB, x.shape[-1])
    q, k, v = blk(q), blk(k), blk(v)
    eye = jnp.asarray(np.eye(n)[:, None, :, None])  # diagonal-block selector [i, t, j, s]

    a_in, a_end, a_pre, a_post, a_mid, a_tot = _decays(a, n)
    qh, kh = q * jnp.exp(a_in), k * jnp.exp(a_end)  # referred to block start / block end
    # row block i sees column block j < i through the key decay of the blocks between
    k_i = kh[..., None, :, :, :] * jnp.exp(a_mid)[..., None, :]
    p_off = jnp.einsum("...itk,...ijsk->...itjs", qh, k_i)
    p_diag = _pairwise(q, k, a_in)  # [..., n, t, s]
    q_in = (qh * jnp.exp(a_pre)[..., None, :]).reshape(*q.shape[:-3], C, -1)
    k_up = kh * jnp.exp(a_post)[..., None, :]
    if b is None:
        p = (p_off + p_diag[..., :, :, None, :] * eye).reshape(*p_off.shape[:-4], C, C)
        o = p @ v.reshape(*v.shape[:-3], C, -1)
        u = jnp.einsum("...jsk,...jsv->...kv", k_up, v)
        return o, q_in, None, u, jnp.exp(a_tot), None
    b_in, b_end, b_pre, b_post, b_mid, b_tot = _decays(b, n)
    vh = v * jnp.exp(b_end)
    v_i = vh[..., None, :, :, :] * jnp.exp(b_mid)[..., None, :]
    o = jnp.einsum("...itjs,...ijsv->...itv", p_off, v_i) * jnp.exp(b_in)
    causal = np.tril(np.ones((SUB, SUB), bool))[..., None]
    w = jnp.exp(jnp.where(causal, b_in[..., :, None, :] - b_in[..., None, :, :], -jnp.inf))
    o = o + jnp.einsum("...ts,...sv,...tsv->...tv", p_diag, v, w)
    out_v = jnp.exp(b_in + b_pre[..., None, :]).reshape(*v.shape[:-3], C, -1)
    u = jnp.einsum("...jsk,...jsv->...kv", k_up, vh * jnp.exp(b_post)[..., None, :])
    return o.reshape(out_v.shape), q_in, out_v, u, jnp.exp(a_tot), jnp.exp(b_tot)


def recurrent_xla(plan, q, k, v, g=None, gk=None, gv=None, g_gamma=None, initial_state=None,
                  cu_seqlens=None, chunk_size=64):
    """SPEC.md's recurrence, chunked, in jax.numpy / lax.

    plan: `bridge.contract.check`'s Plan. q [B,T,H,K], k [B,T,Hk,K],
    v [B,T,Hk,V], g [B,T,H] or [B,T,H,K], gk [B,T,H,K], gv [B,T,H,V],
    g_gamma [H] or [N,H], initial_state [N,H,K,V], cu_seqlens [N+1] (B == 1,
    may be traced). Returns o [B,T,H,V] in q's dtype and final_state
    [N,H,K,V] float32 (float64 for float64 inputs).
    """
    if chunk_size % SUB:
        raise ValueError(f"chunk_size: expected a multiple of {SUB}, got {chunk_size}")
    ct = jnp.float64 if plan.dtype == "float64" else jnp.float32  # accumulation dtype
    H, K, V, N, G = plan.H, plan.K, plan.V, plan.N, plan.group
    lay = _Layout(plan, cu_seqlens, chunk_size)
    f = lambda x: jnp.asarray(x).astype(ct)
    heads = lambda x: jnp.repeat(f(x), G, axis=2) if G > 1 else f(x)  # kv head h // G

    q = lay.chunks(f(q) * plan.scale)
    k, v = lay.chunks(heads(k)), lay.chunks(heads(v))
    a = None  # key-side log decay per token [S,R,H,C,K or 1]
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
        a = jnp.zeros((lay.S, lay.R, H, chunk_size, 1), ct)
    b = lay.chunks(f(gv)) if plan.gv else None
    h0 = f(initial_state) if plan.initial_state else jnp.zeros((N, H, K, V), ct)

    o, q_in, out_v, u, dA, dB = jax.checkpoint(_chunk_terms)(q, k, v, a, b)

    def step(s, xs):
        first, seq, dA, dB, u = xs
        if plan.varlen:  # a sequence's first chunk starts from its own initial state
            s = jnp.where(first[:, None, None, None], h0[seq], s)
        s_out = s * dA[..., None] + u if dB is None else s * dA[..., None] * dB[..., None, :] + u
        return s_out, s

    _, s_in = lax.scan(step, h0[lay.seq[0]], (lay.first, lay.seq, dA, dB, u))
    o_inter = q_in @ s_in
    o = o + (o_inter if out_v is None else o_inter * out_v)
    o = lay.tokens(o).astype(plan.dtype)

    sl, row = lay.last
    fin = s_in[sl, row] * dA[sl, row][..., None]
    if dB is not None:
        fin = fin * dB[sl, row][..., None, :]
    fin = fin + u[sl, row]
    if lay.empty is not None:
        fin = jnp.where(lay.empty[:, None, None, None], h0, fin)
    return o, fin
