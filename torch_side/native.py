"""The chunked form of SPEC.md's recurrence in plain torch ops: the fast CPU path.

Every sequence (a batch row or a `cu_seqlens` segment) is cut into chunks of C
tokens in processing order (backwards with `reverse`), and the chunks of all
sequences are stacked into "slots" [H, M, C, D], ordered by chunk position ("step").
Everything inside a chunk is batched matmuls over the slots; only the K x V state
recurrence runs sequentially, one step per chunk position, over the sequences still
active there. The slots are processed a slab of consecutive steps at a time, gathered
straight from the token-layout inputs and scattered straight into the outputs, so
memory is the outputs plus one slab's workspace. Forward and backward are written
by hand. The backward first runs the state recurrence alone to get the state entering
every chunk, then walks the slabs in reverse order: each recomputes its in-chunk terms
from those states and passes the gradient of its entering state on to the slab before it.

Precision: the decay between tokens j <= i of a chunk is exp(gates summed over
(j, i]). Exponents are always sums of the gates they span, never differences of
long running sums (which cancel and lose ~10x with strong gates). The chunk is
cut into w-blocks; pairs in different blocks are handled level by level (right
half of each 2h-segment against its left half, h = w .. C/2), both factors
referenced at the segment midpoint, so both are exp(<= 0). Inside a w-block the
factors are referenced at the block end (queries get exp(> 0)); w <= SUB is the
widest block whose in-block gate sums stay within LIMIT, so nothing overflows
and in-block cancellation costs at most LIMIT * eps (w = 1 always qualifies).
Moderate gates (|sum| <= LIMIT over a chunk) make the whole chunk one block: no
levels, and every in-chunk product is one C x C matmul.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from bridge.grads import INPUTS

SUB = 64  # widest block (whole chunks at the default chunk size)
TRI = 16  # widest triangular matmul that sums gates (wider blocks add whole pieces' totals)
LIMIT = 30.0  # largest |log decay| an in-block factor may carry (exp(30) ~ 1e13)
# Elements of one slab input [H, slots, C, D], at most: a forward slab holds ~20 such
# arrays besides its output, so a slab input is also kept below 1/SHARE of the output
# (down to SLAB // 4); fewer, larger slabs cost less per op. A backward slab may be BACK
# times larger; at 4 its matmuls ran ~2x below their rate out of cache (the same total
# time as 1 on 2 threads, 1.07x slower on 1, 2.6x the fwd+bwd peak at (2,8,64,64)).
# Smaller slabs (SHARE = 32) cost the forward 1.2-1.4x on 2 threads at (1,4,128,128);
# since the forward frees each temporary when used, 16 keeps its peak below 3x output +
# state there.
SLAB = 1 << 18
SHARE = 16
BACK = 1
STEP_T = 4  # at most this many tokens a row (decoding) run step by step, without chunks


@functools.lru_cache(maxsize=64)
def _table(cu: tuple, C: int, reverse: bool):
    """Chunk slots of the sequences cu[i]:cu[i+1] (host side, cached).

    Sequences are ranked by chunk count, longest first; slots are ordered by chunk
    position ("step"), then rank, so the sequences active at step c are ranks
    [0, cnt[c]) and their slots are contiguous. tok [M*C]: token read by each slot
    position (0 at padding); mask [M, C, 1] (None without padding); seq [M]: sequence
    of each slot; order/unorder: rank <-> sequence. grid: the number of sequences when
    they all have the same whole number of chunks, in order, forwards (then slot
    step * grid + s reads the step-th chunk of sequence s: a strided view), else None.
    """
    cu = np.asarray(cu, dtype=np.int64)
    lens = np.diff(cu)
    nch = -(-lens // C)
    order = np.argsort(-nch, kind="stable")
    active = nch[order][None, :] > np.arange(int(nch.max(initial=0)))[:, None]
    step, rank = np.nonzero(active)
    seq = order[rank]
    pos = step[:, None] * C + np.arange(C)
    valid = pos < lens[seq][:, None]
    tok = np.where(valid, cu[seq + 1][:, None] - 1 - pos if reverse else cu[seq][:, None] + pos, 0)
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
    even = not reverse and len(lens) and (lens == lens[0]).all() and lens[0] % C == 0
    return dict(tok=t(tok.reshape(-1)), seq=t(seq), cnt=active.sum(1).tolist(),
                grid=len(lens) if even else None,
                order=t(order), unorder=t(np.argsort(order)), M=len(seq),
                mask=None if valid.all() else torch.from_numpy(valid[..., None]))


def _excl_cumsum(x, dim, reverse=False):
    """Sum of the entries strictly before (after, with reverse) each position along dim,
    accumulated from the entries themselves."""
    n = x.shape[dim]
    zero = torch.zeros_like(x.narrow(dim, 0, 1))
    if n == 1:
        return zero
    if reverse:
        return torch.cat([x.narrow(dim, 1, n - 1).flip(dim).cumsum(dim).flip(dim), zero], dim)
    return torch.cat([zero, x.narrow(dim, 0, n - 1).cumsum(dim)], dim)


def _mm(a, b):
    """Batched matmul over matching leading dims, through 3-d views so that transposed
    operands reach BLAS as flags rather than as copies."""
    lead = a.shape[:-2]
    return torch.bmm(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:])).view(
        *lead, a.shape[-2], b.shape[-1])


def _part(x, s, side):
    """[.., C, D] -> [.., S, s, D]: the right (side 1) or left (0) halves of the 2s-segments,
    or, when s == C, the whole chunk [.., 1, C, D]."""
    if x.shape[-2] == s:
        return x.unsqueeze(-3)
    return x.unflatten(-2, (-1, 2, s)).select(-3, side)


def _blk(x, e, w, div=False, inplace=False):
    """x [.., C, D] times (or divided by) the per-block tensor e [.., C/w, w, D]; None = 1."""
    if e is None:
        return x
    xb = x.unflatten(-2, (-1, w))
    if inplace:
        (xb.div_ if div else xb.mul_)(e)
        return x
    return (xb / e if div else xb * e).flatten(-3, -2)


class _Side:
    """Log decays of one side (keys: a over K; values: b over V) in w-blocks of each chunk.

    a [H, M, C, D], D = 1 for one scalar per head and step. ea / eb [H, M, C/w, w, D]:
    exp of a summed from the block start through t / after t to the block end; tau
    [H, M, C/w, D] the block totals. Every exponent is a sum of gates (triangular
    matmuls over TRI-pieces plus the totals of whole pieces), never a difference of
    sums. w: the widest block (<= SUB) whose in-block sums stay within LIMIT.
    """

    def __init__(self, ea, eb, tau, w=None):
        self.ea, self.eb, self.tau, self.w = ea, eb, tau, eb.shape[-2] if w is None else w

    @staticmethod
    def of(a, w, updates_only=False):
        """The decays of gates a [H, M, C, D] in blocks of w, or of the widest narrower w
        within LIMIT. updates_only: without ea (None), which only the queries read."""
        s = min(w, TRI)
        x = a.unflatten(-2, (-1, s))
        if w > s:  # blocks of whole TRI-pieces, judged by their sums of |gates|
            tot, mag = x.sum(-2), x.abs().sum(-2)  # [H, M, C/s, D]
            while w > s and float(mag.unflatten(-2, (-1, w // s)).sum(-2).amax()) > LIMIT:
                w //= 2
        while True:
            one = torch.ones(s, s, dtype=a.dtype, device=a.device)
            beta = torch.matmul(one.triu(1), x)
            if w > s or s == 1 or float(beta[..., 0, :].abs().amax()) <= LIMIT:
                break
            w = s = s // 2
            x = a.unflatten(-2, (-1, s))
        alpha = None if updates_only else torch.matmul(one.tril(), x)
        if w > s:  # the pieces before (alpha) and after (beta) in the block
            tot = tot.unflatten(-2, (-1, w // s))
            beta = beta.unflatten(-3, (-1, w // s)).add_(
                _excl_cumsum(tot, -2, reverse=True).unsqueeze(-2)).flatten(-3, -2)
            if alpha is not None:
                alpha = alpha.unflatten(-3, (-1, w // s)).add_(
                    _excl_cumsum(tot, -2).unsqueeze(-2)).flatten(-3, -2)
        if updates_only:
            tau = tot.sum(-2) if w > s else x.sum(-2)
            return _Side(None, beta.exp_(), tau, w)
        tau = alpha[..., -1, :].clone()
        return _Side(alpha.exp_(), beta.exp_(), tau)

    def tensors(self):
        return self.ea, self.eb, self.tau

    def at(self, xs, s, side, inplace=False):
        """xs [.., S, s, D] (a _part) times exp of the whole blocks between each token's block
        and its segment's start (side 1, rows) or end (side 0, columns)."""
        nb = s // self.w
        if nb == 1:
            return xs
        f = _excl_cumsum(_part(self.tau, nb, side), -2, reverse=side == 0).exp().unsqueeze(-2)
        if inplace:
            xs.unflatten(-2, (nb, self.w)).mul_(f)
            return xs
        return (xs.unflatten(-2, (nb, self.w)) * f).flatten(-3, -2)

    def chunk(self, x, side, inplace=False):
        """x [.., C, D] decayed from the chunk start (side 1) or to the chunk end (side 0)."""
        return self.at(x.unsqueeze(-3), x.shape[-2], side, inplace)[..., 0, :, :]

    def total(self):
        """exp of the chunk's whole decay [H, M, D]."""
        return self.tau.sum(-2).exp()


class _NoSide:
    """An absent side: every factor is 1."""
    ea = eb = tau = None
    w = SUB

    def tensors(self):
        return None, None, None

    def at(self, xs, s, side, inplace=False):
        return xs

    def chunk(self, x, side, inplace=False):
        return x

    def total(self):
        return None


def _decay(A, B):
    """Chunk decay of the state, broadcastable to [H, M, K, V], or None."""
    da, db = A.total(), B.total()
    if da is None:
        return None if db is None else db.unsqueeze(-2)
    return da.unsqueeze(-1) if db is None else da.unsqueeze(-1) * db.unsqueeze(-2)


def _cross(R, Z):
    """Gate gradient inside each chunk: sum of R over i >= t plus sum of Z over j < t, for
    R, Z [.., C, D] (triangular matmuls in w-blocks, w <= TRI, then whole blocks)."""
    w = min(TRI, R.shape[-2])
    one = torch.ones(w, w, dtype=R.dtype, device=R.device)
    R, Z = R.unflatten(-2, (-1, w)), Z.unflatten(-2, (-1, w))
    y = torch.matmul(one.triu(), R).add_(torch.matmul(one.tril(-1), Z))
    y += (_excl_cumsum(R.sum(-2), -2, reverse=True) + _excl_cumsum(Z.sum(-2), -2)).unsqueeze(-2)
    return y.flatten(-3, -2)


def _backward(saved, w, levels, cnt, do, dfin):
    """The gradients of _forward's inputs from what it saved: (dq, dk, dv, da, db, dh0) on
    slot-layout tensors; do [H,M,C,V] the output's gradient (0 at padding), dfin the final
    states' [H,N,K,V] (rank order; for a slab, its carry's first, see _forward).

    Gate gradients use d/dA_i = q_i dq_i - k_i dk_i (A_i: gates summed through i), summed
    over i >= t, but with every pair that does not straddle t left out analytically (the
    token's own k_i v_i term and the update's keys after t): what remains is only decayed
    terms, so strong gates give small gradients with small absolute errors.
    """
    q, k, v, qa, kb, qc, vb, qi, ku, vu, Pd, Pii, starts, o, *rest = saved
    A = _Side(*rest[0:3]) if rest[0] is not None else _NoSide()
    B = _Side(*rest[3:6]) if rest[3] is not None else _NoSide()
    Ps = rest[6:]
    blocks = lambda x: x.unflatten(-2, (-1, w))
    dod, doa = _blk(do, B.eb, w, True), _blk(do, B.ea, w)

    # diagonal blocks (with key gates, own terms apart)
    dP = _mm(blocks(dod), blocks(vb).mT).tril_(-1 if A.ea is not None else 0)
    dq_d = _mm(dP, blocks(kb))
    dk, dv = _mm(dP.mT, blocks(qc)).flatten(-3, -2), _mm(Pd.mT, blocks(dod)).flatten(-3, -2)
    # chunk level: the state recurrence backwards; *_u: through the chunk updates
    doi = B.chunk(doa, 1)
    decay = _decay(A, B)
    G, dh0 = _recur_back(_mm(qi.mT, doi), decay, dfin, cnt)
    dq = A.chunk(_mm(doi, starts.mT), 1, inplace=True)
    dk_u = _blk(A.chunk(_mm(vu, G.mT), 0, inplace=True), A.eb, w, inplace=True)
    dv_u = _blk(B.chunk(_mm(ku, G), 0, inplace=True), B.eb, w, inplace=True)
    # levels
    for s, P in zip(levels, Ps):
        qs, ks = A.at(_part(qa, s, 1), s, 1), A.at(_part(kb, s, 0), s, 0)
        vs, dos = B.at(_part(vb, s, 0), s, 0), B.at(_part(doa, s, 1), s, 1)
        dP = _mm(dos, vs.mT)
        _part(dq, s, 1).add_(A.at(_mm(dP, ks), s, 1, inplace=True))
        _part(dk, s, 0).add_(A.at(_mm(dP.mT, qs), s, 0, inplace=True))
        _part(dv, s, 0).add_(B.at(_mm(P.mT, dos), s, 0, inplace=True))
    if A.ea is not None:
        dq = _blk(dq, A.ea, w, inplace=True)
        blocks(dq).addcdiv_(dq_d, A.eb)
    else:
        blocks(dq).add_(dq_d)
    dk, dv = _blk(dk, A.eb, w, inplace=True), _blk(dv, B.eb, w, inplace=True)

    # gates: only pairs straddling t (see the class docstring), plus the decayed entering state
    da = db = None
    if A.ea is not None or B.ea is not None:
        GS = G.mul_(starts) if decay is None else G.mul_(starts).mul_(decay)
    if A.ea is not None:
        R, Z = (q * dq).addcmul_(k, dk, value=-1), k * dk_u
        if A.tau.shape[-1] == 1:
            R, Z = R.sum(-1, keepdim=True), Z.sum(-1, keepdim=True)
            E = GS.sum((-1, -2)).unsqueeze(-1)
        else:
            E = GS.sum(-1)
        da = _cross(R, Z).add_(E.unsqueeze(-2))
    if B.ea is not None:
        R = (do * o).addcmul_(v, dv, value=-1)
        db = _cross(R, v * dv_u).add_(GS.sum(-2).unsqueeze(-2))
    dk, dv = dk.add_(dk_u), dv.add_(dv_u)
    if A.ea is not None:
        dPii = (do * v).sum(-1, keepdim=True)
        dq, dk = dq.addcmul_(dPii, k), dk.addcmul_(dPii, q)
    if B.ea is not None:
        dv = dv.addcmul_(Pii, do)
    return dq, dk, dv, da, db, dh0


def _sides(a, b, C, updates_only=False):
    """The decays of key gates a and value gates b [H, M, C, D] (or None) in w-blocks of
    one common width w, and the levels (segment halves w .. C/2): (A, B, w, levels).
    updates_only: only what _updates reads (see _Side.of)."""
    w = min(SUB, C)
    A = _Side.of(a, w, updates_only) if a is not None else _NoSide()
    B = _Side.of(b, min(A.w, w), updates_only) if b is not None else _NoSide()
    if a is not None and A.w > B.w:  # the value side needed narrower blocks
        A = _Side.of(a, B.w, updates_only)
    w = min(A.w, B.w, w)
    return A, B, w, [w << i for i in range((C // w).bit_length() - 1)]


def _updates(k, v, A, B, w):
    """Keys and values decayed to their block end (kb, vb) and to their chunk end (ku, vu):
    each chunk adds ku^T vu to the state."""
    kb, vb = _blk(k, A.eb, w), _blk(v, B.eb, w)
    return kb, vb, A.chunk(kb, 0), B.chunk(vb, 0)


def _forward(q, k, v, a, b, h0, cnt, after=0, out=True, save=True, starts=None):
    """The recurrence on slot-layout tensors: q [H,M,C,K] (scaled), k [H,M,C,K], v [H,M,C,V],
    a [H,M,C,K|1] or None, b [H,M,C,V] or None, h0 [H,N,K,V] in rank order, cnt the
    sequences active at each step. Zero padding tokens (gate 0) leave the state unchanged.
    `after`: how many sequences go on past these steps (a slab of a longer run; their
    states come back as `carry` [H, after, K, V] and are not among the final states).
    Returns (o [H,M,C,V], final states [H, N - after, K, V] (rank order), carry, the
    tensors _backward reads (None with save=False: each temporary goes when used),
    (w, levels)); with out=False (a backward's recompute) o is None unless _backward
    reads it (value gates). `starts`: the states entering every chunk [H,M,K,V] when
    known (a backward's recompute): then the recurrence is not run and the final states
    and carry are None."""
    A, B, w, levels = _sides(a, b, q.shape[-2])
    blocks = lambda x: x.unflatten(-2, (-1, w))
    out = out or b is not None

    kb, vb, ku, vu = _updates(k, v, A, B, w)
    # the state recurrence first: its [K, V]-per-chunk arrays go before the in-chunk ones come
    fin = carry = None
    if starts is None:
        U = _mm(ku.mT, vu)
        if not save:
            del ku, vu
        starts, fin, carry = _recur(U, _decay(A, B), h0, cnt, after)
        del U
    qa, qc = _blk(q, A.ea, w), _blk(q, A.eb, w, div=True)
    qi = A.chunk(qa, 1)
    o = B.chunk(_mm(qi, starts), 1, inplace=True) if out else None
    if not save:
        del qi, starts
    # diagonal blocks, referenced at the block end; with value gates each token's own term
    # (j = i) apart, for their gradient (see _backward)
    Pd = _mm(blocks(qc), blocks(kb).mT).tril_(-1 if b is not None else 0)
    Pii = (q * k).sum(-1, keepdim=True) if b is not None else None
    # right halves of 2s-segments against their left halves, referenced at the midpoint
    Ps = []
    for s in levels:
        qs, ks = A.at(_part(qa, s, 1), s, 1), A.at(_part(kb, s, 0), s, 0)
        P = _mm(qs, ks.mT)
        del qs, ks
        if out:
            y = _mm(P, B.at(_part(vb, s, 0), s, 0))
            _part(o, s, 1).add_(B.at(y, s, 1, inplace=True))
            del y
        if save:
            Ps.append(P)
        del P
    if out:
        yd = _mm(Pd, blocks(vb))
        if B.eb is not None:
            yd = _blk(yd.flatten(-3, -2), B.eb, w, div=True, inplace=True)
            o = _blk(o, B.ea, w, inplace=True).add_(yd)
        else:
            blocks(o).add_(yd)
        del yd
    saved = None
    if save:
        saved = (q, k, v, qa, kb, qc, vb, qi, ku, vu, Pd, Pii, starts,
                 o if b is not None else None, *A.tensors(), *B.tensors(), *Ps)
    return (torch.addcmul(o, Pii, v) if b is not None else o), fin, carry, saved, (w, levels)


def _recur(U, decay, h0, cnt, after=0):
    """S <- decay * S + U over the chunk steps. U [H, M, K, V] in slot order, h0 [H, N, K, V]
    in rank order. Returns the states entering every chunk [H, M, K, V], the final
    states [H, N - after, K, V] (rank order) and the states of the `after` sequences still
    active past the last step [H, after, K, V] (a slab of a longer run)."""
    starts = torch.empty_like(U)
    starts[:, :cnt[0]] = h0[:, :cnt[0]]
    finals = [h0[:, cnt[0]:]]
    offs = np.cumsum([0] + cnt).tolist()
    carry = h0[:, :0]
    for c, n in enumerate(cnt):
        last = c + 1 == len(cnt)
        nxt = after if last else cnt[c + 1]
        S, u = starts[:, offs[c]:offs[c] + n], U[:, offs[c]:offs[c] + n]
        # write straight into the next step's entering states when no sequence ends here
        e = starts[:, offs[c + 1]:offs[c + 1] + n] if nxt == n and not last else None
        if decay is None:
            e = torch.add(u, S, out=e)
        else:
            e = torch.addcmul(u, decay[:, offs[c]:offs[c] + n], S, out=e)
        if last:
            carry = e[:, :nxt]
        elif nxt < n and nxt:
            starts[:, offs[c + 1]:offs[c + 1] + nxt] = e[:, :nxt]
        if nxt < n:
            finals.append(e[:, nxt:])
    return starts, torch.cat(finals[::-1], 1), carry


def _recur_back(Qt, decay, dfin, cnt):
    """The recurrence's adjoint: G [H, M, K, V], the gradient of the state leaving every chunk,
    and dh0 [H, N, K, V]; Qt [H, M, K, V] is each chunk's direct gradient of its entering state."""
    G = torch.empty_like(Qt)
    dh0 = dfin.clone()
    offs = np.cumsum([0] + cnt).tolist()
    for c in reversed(range(len(cnt))):
        n, nxt, off = cnt[c], cnt[c + 1] if c + 1 < len(cnt) else 0, offs[c]
        g = G[:, off:off + n]
        g[:, nxt:] = dfin[:, nxt:n]  # these sequences end with this chunk
        dst = G[:, offs[c - 1]:offs[c - 1] + n] if c else dh0[:, :n]
        if decay is None:
            torch.add(Qt[:, off:off + n], g, out=dst)
        else:
            torch.addcmul(Qt[:, off:off + n], decay[:, off:off + n], g, out=dst)
    return G, dh0


def _compute_dtype(q):
    """float64 for float64 q, else float32 (SPEC: accumulation)."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _layout(plan, q, cu_seqlens, chunk_size):
    """(chunk table, chunk size C, compute dtype) of a call (see _table)."""
    B, T = plan.B, plan.T
    cu = tuple(b * T for b in range(B + 1)) if cu_seqlens is None else tuple(cu_seqlens.tolist())
    longest = max(e - s for s, e in zip(cu, cu[1:]))
    C = min(chunk_size, 1 << max(longest - 1, 0).bit_length())
    tab = _table(cu, C, plan.reverse)
    if tab["tok"].device != q.device:
        tab = {n: x.to(q.device) if torch.is_tensor(x) else x for n, x in tab.items()}
    return tab, C, _compute_dtype(q)


def recurrent_native(plan, q, k, v, g=None, gk=None, gv=None, g_gamma=None, initial_state=None,
                     cu_seqlens=None, chunk_size=64):
    """SPEC.md's recurrence, chunked. Returns (o [B,T,H,V] in q's dtype, final_state
    [N,H,K,V] float32; float64 for float64 q).

    Batched layout as `plan` (bridge.contract.Plan) describes: q [B,T,H,K], k [B,T,Hk,K],
    v [B,T,Hk,V], g [B,T,H] or [B,T,H,K], gk [B,T,H,K], gv [B,T,H,V], g_gamma [H] or [N,H],
    initial_state [N,H,K,V]; with cu_seqlens [N+1], B == 1. chunk_size: a power of two.
    Differentiable (once): autograd keeps only the inputs (see _Native).
    """
    if chunk_size < 1 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size: expected a power of two, got {chunk_size}")
    inputs = (q, k, v, g, gk, gv, g_gamma, initial_state)
    graph = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in inputs)
    if not graph and cu_seqlens is None and 0 < plan.T <= STEP_T:
        return _steps(plan, _compute_dtype(q), *inputs)
    tab, C, cd = _layout(plan, q, cu_seqlens, chunk_size)
    if graph:
        return _Native.apply(plan, tab, C, cd, *inputs)
    return _streamed(plan, tab, C, cd, *inputs)


class _Native(torch.autograd.Function):
    """recurrent_native under autograd: the streamed forward, saving only the inputs; the
    backward recomputes it slab by slab (_streamed_backward)."""

    @staticmethod
    def forward(ctx, plan, tab, C, cd, *inputs):
        ctx.plan, ctx.tab, ctx.C, ctx.cd = plan, tab, C, cd
        ctx.save_for_backward(*inputs)
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None
        return _streamed(plan, tab, C, cd, *inputs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dfinal_state):
        return (None,) * 4 + tuple(_streamed_backward(
            ctx.plan, ctx.tab, ctx.C, ctx.cd, ctx.saved_tensors, do, dfinal_state))


class _Slots:
    """The token-layout arrays of one call and its chunk table (see _table): gathers slab
    inputs into slot layout [h, m, C, D] and scatters slot-layout results back."""

    def __init__(self, plan, tab, C, cd, q, k, v, g, gk, gv, g_gamma):
        self.plan, self.tab, self.C, self.cd = plan, tab, C, cd
        self.L = plan.B * plan.T
        flat = lambda x: None if x is None else x.reshape(self.L, *x.shape[2:])
        if plan.g == "head":
            g = g.unsqueeze(-1)
        self.q, self.k, self.v, self.g, self.gk, self.gv = map(flat, (q, k, v, g, gk, gv))
        self.gam = None
        if g_gamma is not None:  # [H, 1] per head or [H, N] per sequence
            gam = g_gamma.to(cd)
            self.gam = gam[:, None] if gam.dim() == 1 else gam.t()
        self.tok = tab["tok"].view(-1, C)

    def slabs(self, grow=1):
        """[(r0, r1, cnt, after)]: slots r0:r1 of consecutive chunk steps, as many as fit
        `grow` times the budget (see SLAB; at least one step); cnt: the sequences active at
        each of those steps, after: at the step past them (0 at the end)."""
        plan, cnt = self.plan, self.tab["cnt"]
        offs = np.cumsum([0] + cnt).tolist()
        per_slot = plan.H * self.C * max(plan.K, plan.V)
        budget = grow * min(SLAB, max(SLAB // 4, self.L * plan.H * plan.V // SHARE))
        out, c0 = [], 0
        while c0 < len(cnt):
            c1 = c0 + 1
            while c1 < len(cnt) and (offs[c1 + 1] - offs[c0]) * per_slot <= budget:
                c1 += 1
            out.append((offs[c0], offs[c1], cnt[c0:c1], cnt[c1] if c1 < len(cnt) else 0))
            c0 = c1
        return out

    def keep(self, r0, r1):
        """[m, C, 1] True at real tokens of slots r0:r1, or None without padding."""
        return None if self.tab["mask"] is None else self.tab["mask"][r0:r1]

    def _grid(self, x, r0, r1):
        """x [L, h, D] at slots r0:r1 as a strided view [h, m / n, n, C, D] (see _table's
        grid: n sequences), or None where the slots are not a grid."""
        n = self.tab["grid"]
        if n is None:
            return None
        # slots step * n + s: steps r0 // n .. r1 // n of every sequence s
        xv = x.view(n, -1, self.C, *x.shape[1:])[:, r0 // n:r1 // n]
        return xv.permute(3, 1, 0, 2, 4)

    def gather(self, x, r0, r1, scale=1.0):
        """[L, h, D] -> slots r0:r1 as [h, m, C, D] in the compute dtype, 0 at padding."""
        view = self._grid(x, r0, r1)
        if view is None:
            view = x.index_select(0, self.tok[r0:r1].reshape(-1))
            view = view.view(r1 - r0, self.C, *x.shape[1:]).permute(2, 0, 1, 3).unsqueeze(1)
        y = torch.empty(view.shape, dtype=self.cd, device=x.device)  # one strided copy
        # scaled in the copy, unless x is narrower (then widened first, scaled after)
        if scale != 1.0 and x.dtype == self.cd:
            torch.mul(view, scale, out=y)
        else:
            y.copy_(view)
            if scale != 1.0:
                y.mul_(scale)
        y = y.flatten(1, 2)
        keep = self.keep(r0, r1)
        return y if keep is None else y.mul_(keep)

    def scatter(self, dst, y, r0, r1, scale=1.0):
        """dst [L, h, D] at the tokens of slots r0:r1 <- scale * y [h, m, C, D] (padding left
        out)."""
        view = self._grid(dst, r0, r1)
        if view is not None:  # straight into dst
            y = y.reshape(view.shape)
            if scale != 1.0:
                torch.mul(y, scale, out=view)
            else:
                view.copy_(y)
            return
        y = y.mul(scale) if scale != 1.0 else y
        idx = self.tok[r0:r1].reshape(-1)
        y = y.permute(1, 2, 0, 3).reshape(-1, *dst.shape[1:]).to(dst.dtype)
        keep = self.keep(r0, r1)
        if keep is None:
            dst.index_copy_(0, idx, y)
        else:
            sel = keep.reshape(-1)
            dst.index_copy_(0, idx[sel], y[sel])

    def inputs(self, r0, r1, with_q=True):
        """Slots r0:r1 of (q scaled or None, k, v, key gates a or None, value gates b or None)."""
        plan, C, H, Hk = self.plan, self.C, self.plan.H, self.plan.Hk
        q = self.gather(self.q, r0, r1, plan.scale) if with_q else None
        k, v = self.gather(self.k, r0, r1), self.gather(self.v, r0, r1)
        if Hk != H:  # query head h reads kv head h // (H // Hk)
            k, v = (x.unsqueeze(1).expand(Hk, H // Hk, *x.shape[1:]).flatten(0, 1) for x in (k, v))
        parts = [self.gather(x, r0, r1) for x in (self.g, self.gk) if x is not None]
        if self.gam is not None:  # 0 at padding
            gs = self.gam if self.gam.shape[1] == 1 else self.gam.index_select(
                1, self.tab["seq"][r0:r1])
            gs, keep = gs[..., None, None], self.keep(r0, r1)
            parts.append(gs * keep if keep is not None else gs.expand(H, r1 - r0, C, 1))
        a = functools.reduce(torch.add, parts) if parts else None
        return q, k, v, a, self.gather(self.gv, r0, r1) if self.gv is not None else None

    def by_rank(self, x, N, like):
        """[N, H, K, V] -> [H, N, K, V] in rank order and the compute dtype (zeros for None)."""
        if x is None:
            return torch.zeros(self.plan.H, N, self.plan.K, self.plan.V, dtype=self.cd,
                               device=like.device)
        return x.to(self.cd).transpose(0, 1).index_select(1, self.tab["order"])

    def by_sequence(self, x):
        """by_rank's inverse: [H, N, K, V] -> [N, H, K, V], contiguous."""
        return x.index_select(1, self.tab["unorder"]).transpose(0, 1).contiguous()


def _streamed(plan, tab, C, cd, q, k, v, g, gk, gv, g_gamma, initial_state):
    """recurrent_native's forward, a slab of chunk steps at a time: besides o and the final
    states only one slab's inputs and temporaries (a few tens of SLAB elements) are alive."""
    S = _Slots(plan, tab, C, cd, q, k, v, g, gk, gv, g_gamma)
    o = torch.empty(S.L, plan.H, plan.V, dtype=q.dtype, device=q.device)
    state, finals = S.by_rank(initial_state, plan.N, q), []
    for r0, r1, cnt, after in S.slabs():
        # only o, the final states and the carry: the slab's saved tensors go right away
        y, fin, state = _forward(*S.inputs(r0, r1), state, cnt, after, save=False)[:3]
        finals.append(fin)
        S.scatter(o, y, r0, r1)
        del y
    fin = torch.cat(finals[::-1], 1) if finals else state  # each slab ends the ranks after it
    return o.view(plan.B, plan.T, plan.H, plan.V), S.by_sequence(fin)


def _streamed_backward(plan, tab, C, cd, inputs, do, dfinal_state):
    """Gradients of `inputs` (q, k, v, g, gk, gv, g_gamma, initial_state; None for absent
    ones, and in their place) from do [B,T,H,V] and dfinal_state [N,H,K,V] (either None),
    each in its input's dtype and shape. First the state recurrence alone gives the state
    entering each chunk; then, slab by slab in reverse, _forward recomputes the slab from
    those states and _backward turns the output's gradient and the gradient of the states
    leaving the slab into the slab's input gradients and that of its entering state.
    Memory: the gradients, the chunk-entering states ([H, K, V] a chunk: an input's size
    at K = V = C) and one slab's workspace."""
    q, k, v, g, gk, gv, g_gamma, h0 = inputs
    H, Hk, K, V, N = plan.H, plan.Hk, plan.K, plan.V, plan.N
    if do is None and dfinal_state is None:
        return [None if x is None else torch.zeros_like(x) for x in inputs]
    S = _Slots(plan, tab, C, cd, q, k, v, g, gk, gv, g_gamma)
    slabs, entering, state = S.slabs(BACK), [], S.by_rank(h0, N, q)
    for r0, r1, cnt, after in slabs:  # the states only: no in-chunk terms
        _, sk, sv, a, b = S.inputs(r0, r1, with_q=False)
        A, B, w, _ = _sides(a, b, C, updates_only=True)
        ku, vu = _updates(sk, sv, A, B, w)[2:]
        n = state.shape[1]  # the sequences entering the slab
        starts, _, state = _recur(_mm(ku.mT, vu), _decay(A, B), state, cnt, after)
        entering.append((starts, n))  # every chunk's: the recompute skips the recurrence
    del state

    L, dev = S.L, q.device
    dq = torch.empty(L, H, K, dtype=q.dtype, device=dev)
    dk, dv = (torch.empty(L, Hk, x.shape[-1], dtype=x.dtype, device=dev) for x in (k, v))
    Da = K if plan.g == "key" or gk is not None else 1  # the key gates' last dim
    ga = torch.empty(L, H, Da, dtype=cd, device=dev) if g is not None or gk is not None else None
    dgv = torch.empty(L, H, V, dtype=gv.dtype, device=dev) if gv is not None else None
    dgam = None if g_gamma is None else torch.zeros_like(S.gam)
    do = None if do is None else do.reshape(L, H, V)
    dfin = S.by_rank(dfinal_state, N, q)
    dcarry = dfin if not slabs else dfin[:, :0]  # the gradient of the states leaving a slab
    for (r0, r1, cnt, after), (st, n) in zip(reversed(slabs), reversed(entering)):
        saved, (w, levels) = _forward(*S.inputs(r0, r1), None, cnt, after, out=False,
                                      starts=st)[3:]
        sdo = S.gather(do, r0, r1) if do is not None else torch.zeros(
            H, r1 - r0, C, V, dtype=cd, device=dev)
        # the carry's gradient first, then the final states of the sequences ending here
        dleave = torch.cat([dcarry, dfin[:, after:n]], 1)
        sdq, sdk, sdv, sda, sdb, dcarry = _backward(saved, w, levels, cnt, sdo, dleave)
        del saved, sdo
        S.scatter(dq, sdq, r0, r1, plan.scale)
        if Hk != H:  # a kv head's gradient sums over the query heads that read it
            sdk, sdv = (x.unflatten(0, (Hk, -1)).sum(1) for x in (sdk, sdv))
        S.scatter(dk, sdk, r0, r1)
        S.scatter(dv, sdv, r0, r1)
        if ga is not None:
            S.scatter(ga, sda, r0, r1)
        if dgam is not None:  # summed over the tokens (not the padding) of each head / sequence
            keep = S.keep(r0, r1)
            per = (sda if keep is None else sda * keep).sum((-1, -2))
            if dgam.shape[1] == 1:
                dgam += per.sum(1, keepdim=True)
            else:
                dgam.index_add_(1, tab["seq"][r0:r1], per)
        if dgv is not None:
            S.scatter(dgv, sdb, r0, r1)
        del sdq, sdk, sdv, sda, sdb

    out = dict(q=dq, k=dk, v=dv, gv=dgv)
    if g is not None:
        out["g"] = ga.sum(-1) if plan.g == "head" and Da > 1 else ga
    if gk is not None:
        out["gk"] = ga
    if g_gamma is not None:
        out["g_gamma"] = dgam[:, 0] if g_gamma.dim() == 1 else dgam.t()
    if h0 is not None:
        out["initial_state"] = S.by_sequence(dcarry)
    return [None if x is None else out[n].reshape(x.shape).to(x.dtype)
            for n, x in zip(INPUTS, inputs)]


def recurrent_native_backward(plan, inputs, cu_seqlens, do, dfinal_state, chunk_size=64):
    """{name: gradient} of the present inputs (`inputs`: the arrays of
    `bridge.grads.INPUTS` by name, absent ones None), each in its input's dtype and shape;
    `do` [B,T,H,V] and `dfinal_state` [N,H,K,V] may be None. Nothing of the forward is
    kept (an op's outputs need fixed shapes): the slab-by-slab backward recomputes it
    (_streamed_backward)."""
    tab, C, cd = _layout(plan, inputs["q"], cu_seqlens, chunk_size)
    got = _streamed_backward(plan, tab, C, cd, tuple(inputs[n] for n in INPUTS), do,
                             dfinal_state)
    return {n: d for n, d in zip(INPUTS, got) if d is not None}


def _steps(plan, cd, q, k, v, g, gk, gv, g_gamma, initial_state):
    """Decoding (a few tokens a row, no cu_seqlens, no autograd): the recurrence itself,
    S <- e^{a_t} S e^{b_t} + k_t^T v_t and o_t = scale q_t S, one step a token on the
    [B, H, K, V] state; no chunks, no tables. At this size an op's dispatch costs as much
    as its work, so a step is few ops on views: the first decay makes the state's own
    copy (the input state is never written), the update adds k_t^T v_t in place with each
    kv head broadcast over its query heads."""
    B, T, H, Hk, K, V = plan.B, plan.T, plan.H, plan.Hk, plan.K, plan.V
    G = H // Hk  # query head h reads kv head h // G
    wide = lambda x: x if x.dtype == cd else x.to(cd)  # no op when already in cd
    gam = None if g_gamma is None else wide(g_gamma).expand(B, H).unsqueeze(-1)
    S, own = (None if initial_state is None else wide(initial_state)), False
    o = torch.empty(T, B * H, 1, V, dtype=q.dtype, device=q.device)  # o[t]: a bmm's shape
    for t in (reversed(range(T)) if plan.reverse else range(T)):
        a = None  # the key-side log decay [B, H, K or 1] of this step
        for x in (None if g is None else g.select(1, t).unsqueeze(-1) if plan.g == "head"
                  else g.select(1, t), None if gk is None else gk.select(1, t), gam):
            if x is not None:
                a = wide(x) if a is None else a + wide(x)
        for d, side in ((a, -1), (None if gv is None else wide(gv.select(1, t)), -2)):
            if d is not None and S is not None:
                d = d.exp().unsqueeze(side)
                S, own = (S.mul_(d) if own else S * d), True
        kt, vt = wide(k.select(1, t)), wide(v.select(1, t))  # [B, Hk, K], [B, Hk, V]
        if S is None:  # no initial state: the first step's state is k_t^T v_t
            # its own memory: with Hk == 1 a reshape of the expansion is a stride-0 view
            S = (kt.view(B, Hk, 1, K, 1) * vt.view(B, Hk, 1, 1, V)).expand(
                B, Hk, G, K, V).contiguous().view(B, H, K, V)
        else:
            if not own:
                S = S.clone(memory_format=torch.contiguous_format)
            S.view(B, Hk, G, K, V).addcmul_(kt.view(B, Hk, 1, K, 1), vt.view(B, Hk, 1, 1, V))
        own = True
        qt, St = wide(q.select(1, t)).reshape(B * H, 1, K), S.view(B * H, K, V)
        if o.dtype == cd:  # o_t = scale q_t S written in place
            o.select(0, t).baddbmm_(qt, St, beta=0, alpha=plan.scale)
        else:
            o.select(0, t).copy_(torch.bmm(qt, St).mul_(plan.scale))
    o = o.view(T, B, H, V)
    return (o.view(B, T, H, V) if T == 1 else o.transpose(0, 1).contiguous()), S
