"""Chunked gated linear attention in plain jax.numpy / lax (SPEC.md's recurrence).

Tokens go into chunks of `chunk_size` through a static-size chunk table that
also serves traced `cu_seqlens`. Each chunk's own output and state update are
computed for all chunks and heads at once (batched matmuls over Z = chunks x
heads); only the cheap elementwise state recurrence runs in a `lax.scan` over
chunks. Log decays are summed inside 16-token blocks and combined through
reference points (a segment midpoint, a block or chunk boundary), so every
exponent is a sum of gates that is <= 0 for gates <= 0 (strong gates cannot
overflow) and none is a difference of two sums (no precision depends on the
gates' magnitude; -inf, clamped, is an exact reset).
The in-chunk part for key-dim gates without gv (the GLA case), in float32,
has a hand-written backward (xla_intra.py: faster than autodiff of the tree);
everything else, and float64 (forward-mode checks), is JAX autodiff of
`all_chunks`.

Where the derivative is a custom VJP anyway (key-dim gates without gv, no cu_seqlens),
`Slabs` runs instead: a scan over slabs of chunks straight from the token layout into
the output, the in-chunk weights of a forward one matmul against the chunk start where
its decays allow (xla_intra.block_p). Its memory is the output plus one slab;
differentiated, it also keeps each slab's entering state, and the backward recomputes
the slabs in reverse (fwd+bwd temporaries: a small fraction of differentiating
`all_chunks`). Tuning knobs: XlaConfig, passed down from recurrent_xla; the measurements
that set them are in BENCHMARKS.md ("Tuning history of the CPU paths").
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from bridge.decay import key_decay

from .chunk_layout import Layout
from .sharding import vary, varying
from .xla_decay import SUB, level, local, rowdot, spans
from .xla_intra import forward_p, key_intra, tree_p



@dataclass(frozen=True)
class XlaConfig:
    """The slab scan's knobs (`Slabs`) and the decoding threshold. stream_chunk: the slab
    scan's chunk (at most the caller's chunk_size; smaller chunks halve the in-chunk FLOPs
    per token); slab_tokens: tokens per scan step; bwd_chunk: the backward's chunk (it
    recomputes each slab; used where it tiles the slab); stepwise_tokens: at most this many
    tokens a row (decoding) run step by step, without chunks."""

    stream_chunk: int = 32
    slab_tokens: int = 256
    bwd_chunk: int = 32
    stepwise_tokens: int = 4


DEFAULT = XlaConfig()


def _scalar_intra(q, k, v, ka):
    """_intra for one decay per head and step (ka = local(a) of a [Z,C,1]): the whole
    [C, C] weight matrix is cheap, so P = (q k^T) * W in one matmul. Log weights, each a
    sum of gates, never a difference of two: inside a 16-block, the pair's highest
    differing bit picks the level h whose midpoint splits it (mid(h)_t + mid(h)_s), else
    alpha_t + (whole blocks between) + beta_s."""
    Z, C, _ = q.shape
    nb = C // SUB
    tot = [ka.tau[:, i, 0] for i in range(nb)]
    mid = [[None] * nb for _ in range(nb)]  # mid[i][j]: blocks strictly between j < i
    for i in range(nb):
        for j in range(i - 1, -1, -1):
            mid[i][j] = jnp.zeros_like(tot[0]) if j == i - 1 else mid[i][j + 1] + tot[j + 1]
            mid[j][i] = jnp.zeros_like(tot[0])  # upper blocks: masked below
        mid[i][i] = jnp.zeros_like(tot[0])
    mid = jnp.stack([jnp.stack(r, -1) for r in mid], -2)  # [Z, nb, nb]
    mid = jnp.repeat(jnp.repeat(mid, SUB, 1), SUB, 2)
    pos = np.arange(C)
    same = (pos[:, None] // SUB) == (pos[None, :] // SUB)
    bit = np.where(same, np.bitwise_xor(pos[:, None], pos[None, :]), 0)
    logw = ka.alpha[:, :, None, 0] + mid + ka.beta[:, None, :, 0]
    for lv in range(SUB.bit_length() - 1):  # h = 1, 2, 4, 8
        m = ka.mid(1 << lv)
        pair = m[:, :, None, 0] + m[:, None, :, 0]
        logw = jnp.where((bit >> lv) == 1, pair, logw)
    logw = jnp.where(same & (bit == 0), 0.0, logw)  # the diagonal
    causal = np.tril(np.ones((C, C), bool))
    w = jnp.exp(jnp.where(causal, logw, -jnp.inf))
    return (jnp.einsum("ztk,zsk->zts", q, k) * w) @ v


def has_custom_vjp(plan) -> bool:
    """Whether `_intra` takes the hand-written VJP (no forward mode): key-dim gates
    (K > 1) without gv, accumulated in float32."""
    return (plan.g == "key" or plan.gk) and plan.K > 1 and not plan.gv \
        and plan.dtype != "float64"


def _intra(q, k, v, a, b):
    """Causal in-chunk output sum_{s<=t} (sum_d q_td k_sd e^{A_td-A_sd}) v_s e^{B_t-B_s}.

    q, k [Z,C,K], v [Z,C,V], a [Z,C,K or 1], b [Z,C,V] or None. A binary tree
    over the chunk: the block of each 2h-segment's right half against its left
    half factors through the segment midpoint (exponents <= 0 on both sides), so
    no pairwise exponentials are needed; blocks of h >= 4 are batched matmuls.
    """
    Z, C, K = q.shape
    ka, va = local(a), None if b is None else local(b)
    if a.shape[-1] == 1 and b is None:
        return _scalar_intra(q, k, v, ka), ka, va
    if b is None:
        # float32: the hand-written backward (no forward mode); float64 (the
        # finite-difference checks) differentiates the same tree with autodiff
        if q.dtype == jnp.float32:
            return key_intra(q, k, v, a), ka, va
        return tree_p(q, k, ka) @ v, ka, va
    o = rowdot(q, k)[..., None] * v
    h = 1
    while h < C:
        n = C // (2 * h)
        seg = lambda x: x.reshape(Z, n, 2, h, x.shape[-1])
        eq, ek = level(ka, h)
        qf, kf = seg(q)[:, :, 1] * jnp.exp(eq), seg(k)[:, :, 0] * jnp.exp(ek)
        if h >= 4:
            cross = jnp.einsum("znik,znjk->znij", qf, kf)
        else:  # too small for a matmul
            cross = rowdot(qf[:, :, :, None, :], kf[:, :, None, :, :])
        fq, fk = level(va, h)
        vf = seg(v)[:, :, 0] * jnp.exp(fk)
        c = jnp.einsum("znij,znjv->zniv", cross, vf) * jnp.exp(fq)
        o = o + jnp.stack([jnp.zeros_like(c), c], 2).reshape(o.shape)
        h *= 2
    return o, ka, va


def recurrent_xla(plan, q, k, v, g=None, gk=None, gv=None, g_gamma=None, initial_state=None,
                  cu_seqlens=None, chunk_size=64, config: XlaConfig = DEFAULT):
    """SPEC.md's recurrence, chunked, in jax.numpy / lax.

    plan: `bridge.contract.check`'s Plan. q [B,T,H,K], k [B,T,Hk,K],
    v [B,T,Hk,V], g [B,T,H] or [B,T,H,K], gk [B,T,H,K], gv [B,T,H,V],
    g_gamma [H] or [N,H], initial_state [N,H,K,V], cu_seqlens [N+1] (B == 1,
    may be traced). config: the tuning knobs (XlaConfig). Returns o [B,T,H,V] in
    q's dtype and final_state [N,H,K,V] float32 (float64 for float64 inputs).
    """
    if chunk_size < SUB or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size: expected a power of two >= {SUB}, got {chunk_size}")
    if not plan.varlen and 0 < plan.T <= config.stepwise_tokens:
        return stepwise(plan, q, k, v, g, gk, gv, g_gamma, initial_state)
    if not plan.varlen and has_custom_vjp(plan):
        return _slabbed(plan, (q, k, v, g, gk, gv, g_gamma, initial_state), chunk_size, config)
    return all_chunks(plan, q, k, v, g, gk, gv, g_gamma, initial_state, cu_seqlens, chunk_size)


def stepwise(plan, q, k, v, g=None, gk=None, gv=None, g_gamma=None, initial_state=None):
    """Decoding (a few tokens a row, no cu_seqlens): the recurrence itself, one step a
    token on the [B, H, K, V] state, S <- e^{a_t} S e^{b_t} + k_t^T v_t, o_t = scale q_t S;
    no chunk layout. Plain JAX autodiff (forward mode too)."""
    ct = jnp.float64 if plan.dtype == "float64" else jnp.float32
    B, T, H, K, V, G = plan.B, plan.T, plan.H, plan.K, plan.V, plan.group
    S = (jnp.asarray(initial_state, ct) if plan.initial_state
         else jnp.zeros((B, H, K, V), ct))
    gam = None if g_gamma is None else jnp.broadcast_to(jnp.asarray(g_gamma, ct), (B, H))
    col = lambda x, t: jnp.asarray(x)[:, t].astype(ct)
    o = [None] * T
    for t in (reversed(range(T)) if plan.reverse else range(T)):
        a = key_decay(None if g is None else col(g, t)[..., None] if plan.g == "head"
                      else col(g, t), None if gk is None else col(gk, t),
                      None if gam is None else gam[..., None])
        if a is not None:
            S = jnp.exp(a)[..., None] * S  # (as a plain update: same program)
        if gv is not None:
            S = jnp.exp(col(gv, t))[..., None, :] * S
        kt, vt = col(k, t), col(v, t)
        if G > 1:  # query head h reads kv head h // G
            kt, vt = jnp.repeat(kt, G, axis=1), jnp.repeat(vt, G, axis=1)
        S = S + kt[..., :, None] * vt[..., None, :]
        o[t] = jnp.einsum("bhk,bhkv->bhv", col(q, t) * plan.scale, S)
    return jnp.stack(o, 1).astype(plan.dtype), S


def _slabbed(plan, inputs, C, config):
    """recurrent_xla for key-dim gates without gv (no cu_seqlens), differentiable with
    bounded memory: the value from the slab scan (`Slabs.forward`), which keeps only
    each slab's entering state [S, B, H, K, V] for the backward; the backward
    (`Slabs.backward`) walks the slabs in reverse and recomputes each slab's terms there,
    so its temporaries are one slab's, not the whole sequence's."""
    q, k, v, g, gk, _, g_gamma, initial_state = inputs
    geo = Slabs(plan, C, config)
    h0, seqs, gam = geo.inputs(q, k, v, g, gk, g_gamma, initial_state)

    @jax.custom_vjp
    def run(h0, seqs, gam):
        return geo.forward(h0, seqs, gam)[:2]

    def fwd(h0, seqs, gam):
        o, fin, states = geo.forward(h0, seqs, gam, keep=True)
        return (o, fin), (states, seqs, gam)

    run.defvjp(fwd, lambda res, ct: geo.backward(*res, *ct))
    return geo.unpad(*run(h0, seqs, gam))


def streamed(plan, q, k, v, g=None, gk=None, gv=None, g_gamma=None, initial_state=None,
             chunk_size=64, config: XlaConfig = DEFAULT):
    """The forward alone (no cu_seqlens, no gv) as the slab scan of `Slabs` (autodiff of
    it would keep every slab's terms: recurrent_xla differentiates `_slabbed`). Same
    arguments and results as `recurrent_xla`."""
    geo = Slabs(plan, chunk_size, config)
    return geo.unpad(*geo.forward(*geo.inputs(q, k, v, g, gk, g_gamma, initial_state))[:2])


class Slabs:
    """The slab scan (no cu_seqlens; key-side gates, no gv): `n` chunks of C tokens
    (C = min(chunk_size, config.stream_chunk)) of every row and head per `lax.scan` step, read
    straight from the (padded) token layout [B, S*W, h, D] and written into the output
    in place. Besides the output and the state, only one slab's temporaries are live,
    and each step's ops are large enough that XLA's per-op cost stays small."""

    def __init__(self, plan, chunk_size, config: XlaConfig = DEFAULT):
        self.plan = plan
        self.ct = jnp.float64 if plan.dtype == "float64" else jnp.float32
        self.C = C = min(chunk_size, config.stream_chunk)
        n = max(1, config.slab_tokens // C)
        self.n = n = min(n, max(1, -(-plan.T // C)))
        self.W = W = n * C  # tokens a step
        self.S = max(1, -(-plan.T // W))
        # the backward's chunks: larger ones where they tile the slab
        cb = min(chunk_size, config.bwd_chunk)
        self.Cb = cb if W % cb == 0 else C

    def inputs(self, q, k, v, g, gk, g_gamma, initial_state):
        """(h0 [B,H,K,V], seqs: q, k, v and the present key-side gates in the padded
        token layout [B, S*W, h, D], gam [B, H] or None), in the scan's dtypes."""
        plan, ct, T, SW = self.plan, self.ct, self.plan.T, self.S * self.W
        B, H, K, V = plan.B, plan.H, plan.K, plan.V
        f = lambda x: None if x is None else jnp.asarray(x)
        q, k, v, g, gk = map(f, (q, k, v, g, gk))
        if plan.g == "head":
            g = g[..., None]
        seqs = tuple(x for x in (q, k, v, g, gk) if x is not None)
        if SW != T:  # zero tokens (gate 0) at the end leave o and the state unchanged
            end = ((SW - T, 0) if plan.reverse else (0, SW - T))
            seqs = tuple(jnp.pad(x, ((0, 0), end, (0, 0), (0, 0))) for x in seqs)
        gam = None
        if plan.g_gamma != "none":
            gam = jnp.asarray(g_gamma, ct)
            gam = gam if plan.g_gamma == "seq" else jnp.broadcast_to(gam, (B, H))
        h0 = (jnp.asarray(initial_state, ct) if plan.initial_state
              else jnp.zeros((B, H, K, V), ct))
        return h0, seqs, gam

    def unpad(self, o, fin):
        T, SW = self.plan.T, self.S * self.W
        return (o[:, SW - T:] if self.plan.reverse else o[:, :T]), fin

    def start(self, c):
        """First token of step c's slab in the padded token layout."""
        return (self.S - 1 - c if self.plan.reverse else c) * self.W

    def take(self, x, c):
        return lax.dynamic_slice_in_dim(x, self.start(c), self.W, axis=1)

    def put(self, buf, x, c):
        return lax.dynamic_update_slice_in_dim(buf, x.astype(buf.dtype), self.start(c), axis=1)

    def forward(self, h0, seqs, gam, keep=False):
        """(o [B, S*W, H, V], final state, the state entering each step [S, B, H, K, V]
        if `keep` else None)."""
        plan = self.plan
        # inside shard_map (check_vma) the buffer the scan writes into varies like the inputs
        o0 = vary(jnp.zeros((plan.B, self.S * self.W, plan.H, plan.V), plan.dtype),
                  varying(h0, *seqs, gam))

        def step(carry, c):
            s, out = carry
            xs = [self.take(x, c) for x in seqs]
            o, s_out = self.step(s, xs, gam, c, self.C, False, seqs)
            return (s_out, self.put(out, o, c)), (s if keep else None)

        (fin, o), states = lax.scan(step, (h0, o0), jnp.arange(self.S))
        return o, fin, states

    def backward(self, states, seqs, gam, do, dfin):
        """Cotangents (h0, seqs, gam) from those of forward's (o, final state): a reverse
        scan over the slabs, each recomputed from its entering state (`jax.vjp` of `step`
        with the in-chunk part's hand-written backward), its cotangents written in place."""
        axes = varying(states, do, dfin, *seqs, gam)
        bufs = tuple(vary(jnp.zeros_like(x), axes) for x in seqs)
        dgam = None if gam is None else vary(jnp.zeros_like(gam), axes)
        ds = vary(dfin.astype(self.ct), axes)

        def step(carry, c):
            ds, bufs, dgam = carry
            f = lambda s, xs, gam: self.step(s, xs, gam, c, self.Cb, True)
            _, pull = jax.vjp(f, states[c], [self.take(x, c) for x in seqs], gam)
            ds, dxs, dg = pull((self.take(do, c).astype(self.ct), ds))
            bufs = tuple(self.put(b, d, c) for b, d in zip(bufs, dxs))
            return (ds, bufs, None if gam is None else dgam + dg), None

        (dh0, bufs, dgam), _ = lax.scan(step, (ds, bufs, dgam), jnp.arange(self.S),
                                        reverse=True)
        return dh0, bufs, dgam

    def step(self, s, xs, gam, c, C, differentiable, seqs=None):
        """Step c's slab: s [B,H,K,V] entering, xs its token-layout slices [B, W, h, D]
        (q, k, v, gates), in C-token chunks -> (o [B, W, H, V], the state after it).
        `differentiable`: the in-chunk part through key_intra (its hand-written VJP),
        else the forward-only weights (forward_p). seqs: the inputs xs were taken from;
        forward_p's tree fallback then relays out q, k and the in-block sums inside its
        branch (not on every step, for a branch rarely taken)."""
        plan, ct, W = self.plan, self.ct, self.W
        B, H, K, V, G = plan.B, plan.H, plan.K, plan.V, plan.group
        n = W // C

        def tokens(x):
            """In processing order and the scan's dtype, [B, W, h, D]."""
            return (jnp.flip(x, 1) if plan.reverse else x).astype(ct)

        def chunks(x, c=C):
            """[B, n*c, h, D] -> [B*H*n, c, D]: chunks of every row and head."""
            x = x.reshape(B, n, c, *x.shape[2:]).transpose(0, 3, 1, 2, 4)
            x = jnp.repeat(x, G, axis=1) if G > 1 and x.shape[1] != H else x
            return x.reshape(B * H * n, c, x.shape[-1])

        def q_k(xq, xk):
            """The slab's queries (scaled) and keys in chunks."""
            return chunks(tokens(xq)) * plan.scale, chunks(tokens(xk))

        cq, ck = q_k(*xs[:2])
        tv, *a = map(tokens, xs[2:])
        if gam is not None:
            pos = c * W + jnp.arange(W)
            a.append(jnp.where((pos < plan.T)[None, :, None], gam[:, None], 0.0)[..., None])
        a = jnp.broadcast_to(sum(a[1:], a[0]), (B, W, H, K))
        # in-block sums in the token layout (heads in the minor dim: larger dots, and no
        # relayout of the gates), then into chunks with their consumers
        la = local(a.reshape(B * n, C, H * K))

        def blocks():
            """local(a) of the chunks (xla_decay.Sums of [B*H*n, C or C/16, K])."""
            return la.map(lambda x: chunks(x.reshape(B, -1, H, K), x.shape[1]))

        ka = blocks()
        cv = chunks(tv)
        into, out = spans(ka, C)
        q_in, k_up = cq * jnp.exp(into), ck * jnp.exp(out)  # (e^into: block_p's too)
        dA = jnp.exp(jnp.sum(ka.tau, 1))
        u = jnp.einsum("zck,zcv->zkv", k_up, cv)
        dA, u = dA.reshape(B * H, n, K, 1), u.reshape(B * H, n, K, V)
        s = s.reshape(B * H, K, V)
        entering = []
        for i in range(n):  # the state recurrence over the slab's chunks
            entering.append(s)
            s = s * dA[:, i] + u[:, i]
        entering = jnp.stack(entering, 1).reshape(-1, K, V)
        if differentiable:
            o = key_intra(cq, ck, cv, chunks(a))
        else:
            load = None if seqs is None else lambda: (  # noqa: E731
                *q_k(self.take(seqs[0], c), self.take(seqs[1], c)), blocks())
            o = forward_p(cq, ck, ka, into, load) @ cv
        o = o + q_in @ entering
        o = o.reshape(B, H, W, V).transpose(0, 2, 1, 3)
        return (jnp.flip(o, 1) if plan.reverse else o), s.reshape(B, H, K, V)


def all_chunks(plan, q, k, v, g, gk, gv, g_gamma, initial_state, cu_seqlens, chunk_size):
    """recurrent_xla on all chunks at once (see the module docstring)."""
    ct = jnp.float64 if plan.dtype == "float64" else jnp.float32  # accumulation dtype
    H, K, V, N, G = plan.H, plan.K, plan.V, plan.N, plan.group
    lay = Layout(plan, cu_seqlens, chunk_size)
    f = lambda x: jnp.asarray(x).astype(ct)
    heads = lambda x: jnp.repeat(f(x), G, axis=2) if G > 1 else f(x)  # kv head h // G

    q = lay.chunks(f(q) * plan.scale)
    k, v = lay.chunks(heads(k)), lay.chunks(heads(v))
    a = lay.key_decay(plan, g, gk, g_gamma, ct)  # [S,R,H,C,K or 1]
    if a is None:
        a = jnp.zeros((lay.S, lay.R, H, chunk_size, 1), ct)
    b = lay.chunks(f(gv)) if plan.gv else None
    h0 = f(initial_state) if plan.initial_state else jnp.zeros((N, H, K, V), ct)

    flat = lambda x: None if x is None else x.reshape(-1, chunk_size, x.shape[-1])
    o, dA, dB, u, q_in, out_v = _chunk_terms(*map(flat, (q, k, v, a, b)))

    RH = lay.R * H
    step_in = lambda x: None if x is None else x.reshape(lay.S, RH, *x.shape[1:])

    def step(s, xs):
        first, seq, dA, dB, u = xs
        if plan.varlen:  # a sequence's first chunk starts from its own initial state
            s = jnp.where(first[:, None, None, None], h0[seq], s)
        s = s.reshape(RH, K, V)
        s_out = s * dA[..., None] if dB is None else s * dA[..., None] * dB[..., None, :]
        return (s_out + u).reshape(lay.R, H, K, V), s

    _, s_in = lax.scan(step, h0[lay.seq[0]], (lay.first, lay.seq, step_in(dA), step_in(dB),
                                                step_in(u)))
    o_inter = jnp.einsum("zck,zkv->zcv", q_in, s_in.reshape(-1, K, V))
    o = o + (o_inter if out_v is None else o_inter * out_v)
    o = lay.tokens(o.reshape(lay.S, lay.R, H, chunk_size, V)).astype(plan.dtype)

    # final state = the state after each sequence's last chunk
    z = (lay.last[0] * lay.R + lay.last[1])[:, None] * H + jnp.arange(H)  # [N, H]
    fin = s_in.reshape(-1, K, V)[z] * dA[z][..., None]
    if dB is not None:
        fin = fin * dB[z][..., None, :]
    fin = fin + u[z]
    if lay.empty is not None:
        fin = jnp.where(lay.empty[:, None, None, None], h0, fin)
    return o, fin


def _chunk_terms(q, k, v, a, b):
    """All per-chunk work, batched over Z = chunks x heads: the in-chunk output
    [Z,C,V], the chunk's total decays dA [Z,K or 1], dB [Z,V] or None, its state
    update U [Z,K,V], and q_in [Z,C,K], out_v [Z,C,V] or None for the output
    from the incoming state S: (q_in @ S) * out_v."""
    C = q.shape[1]
    o, ka, va = _intra(q, k, v, a, b)
    into, out = spans(ka, C)
    q_in, k_up, dA = q * jnp.exp(into), k * jnp.exp(out), jnp.exp(jnp.sum(ka.tau, 1))
    out_v = dB = None
    if b is not None:
        into, out = spans(va, C)
        out_v, v, dB = jnp.exp(into), v * jnp.exp(out), jnp.exp(jnp.sum(va.tau, 1))
    u = jnp.einsum("zck,zcv->zkv", k_up, v)
    return o, dA, dB, u, q_in, out_v
