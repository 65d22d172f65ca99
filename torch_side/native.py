"""The chunked form of SPEC.md's recurrence in plain torch ops: the fast CPU path.

Every sequence (a batch row or a `cu_seqlens` segment) is cut into chunks of C
tokens in processing order (backwards with `reverse`), and the chunks of all
sequences are stacked into one batch of "slots" [H, M, C, D]. Everything inside
a chunk is batched matmuls over all slots; only the K x V state recurrence runs
sequentially, one step per chunk position, over the sequences still active
there. Forward and backward of that core are written by hand (autograd would
zero-fill and copy far more); relayout and gate sums around it use autograd.

Precision: the decay between tokens j <= i of a chunk is exp(gates summed over
(j, i]). Exponents are always sums of the gates they span, never differences of
long running sums (which cancel and lose ~10x with strong gates). The chunk is
cut into w-blocks; pairs in different blocks are handled level by level (right
half of each 2h-segment against its left half, h = w .. C/2), both factors
referenced at the segment midpoint, so both are exp(<= 0). Inside a w-block the
factors are referenced at the block end (queries get exp(> 0)); w <= 16 is the
widest block whose in-block gate sums stay within LIMIT, so nothing overflows
and in-block cancellation costs at most LIMIT * eps (w = 1 always qualifies).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

SUB = 16  # widest block
LIMIT = 30.0  # largest |log decay| an in-block factor may carry (exp(30) ~ 1e13)
# Elements of one slab input [H, slots, C, D] of the forward without autograd, at most:
# it holds ~20 such arrays besides its output, so a slab input is also kept below 1/16 of
# the output (down to SLAB // 4); fewer, larger slabs cost less per op
SLAB = 1 << 18
STEP_T = 4  # at most this many tokens a row (decoding) run step by step, without chunks


@functools.lru_cache(maxsize=64)
def _table(cu: tuple, C: int, reverse: bool):
    """Chunk slots of the sequences cu[i]:cu[i+1] (host side, cached).

    Sequences are ranked by chunk count, longest first; slots are ordered by chunk
    position ("step"), then rank, so the sequences active at step c are ranks
    [0, cnt[c]) and their slots are contiguous. tok [M*C]: token read by each slot
    position (0 at padding); mask [M, C, 1] (None without padding); inv [L]: slot
    position of each token; seq [M]: sequence of each slot; order/unorder: rank <-> sequence.
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
    inv = np.zeros(int(cu[-1]), dtype=np.int64)
    inv[tok[valid]] = np.flatnonzero(valid)
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
    # equal lengths in whole chunks, forwards: the relayout is a plain transpose
    plain = not reverse and len(lens) and (lens == lens[0]).all() and lens[0] % C == 0
    return dict(tok=t(tok.reshape(-1)), inv=t(inv), seq=t(seq), cnt=active.sum(1).tolist(),
                order=t(order), unorder=t(np.argsort(order)), M=len(seq),
                mask=None if valid.all() else torch.from_numpy(valid[..., None]),
                plain=(len(lens), int(lens[0]) // C) if plain else None)


def _to_chunks(x, tab, C):
    """[L, h, D] -> [h, M, C, D], zero at padding."""
    if tab["plain"]:
        y = x.view(*tab["plain"], C, *x.shape[1:]).permute(3, 1, 0, 2, 4)
        return y.reshape(x.shape[1], -1, C, x.shape[2])
    y = x.transpose(0, 1).index_select(1, tab["tok"]).unflatten(1, (-1, C))
    return y if tab["mask"] is None else y.mul_(tab["mask"])


def _to_tokens(y, tab):
    """[h, M, C, D] -> [L, h, D]."""
    if tab["plain"]:
        h, M, C, D = y.shape
        y = y.view(h, tab["plain"][1], tab["plain"][0], C, D)
        return y.permute(2, 1, 3, 0, 4).reshape(-1, h, D)
    return y.flatten(1, 2).transpose(0, 1).index_select(0, tab["inv"])


class _Relayout(torch.autograd.Function):
    """Token layout [L, h, D] <-> slot layout [h, M, C, D]: a permutation plus padding, so
    each direction's gradient is the other direction (no scatter)."""

    @staticmethod
    def forward(ctx, x, tab, C, to_chunks, scale=1.0):
        ctx.tab, ctx.C, ctx.to_chunks, ctx.scale = tab, C, to_chunks, scale
        return _Relayout.move(x, tab, C, to_chunks, scale)

    @staticmethod
    def backward(ctx, g):
        dx = _Relayout.move(g, ctx.tab, ctx.C, not ctx.to_chunks, ctx.scale)
        return dx, None, None, None, None

    @staticmethod
    def move(x, tab, C, to_chunks, scale):
        y = _to_chunks(x, tab, C) if to_chunks else _to_tokens(x, tab)
        if y.data_ptr() == x.data_ptr():  # a view (B == 1): a contiguous copy, never an alias
            y = y.clone(memory_format=torch.contiguous_format)
        return y.mul_(scale) if scale != 1.0 else y


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
    [H, M, C/w, D] the block totals. Every exponent is a sum of gates (a triangular
    matmul), never a difference of sums. w: the widest block (<= SUB) whose in-block
    sums stay within LIMIT.
    """

    def __init__(self, ea, eb, tau):
        self.ea, self.eb, self.tau, self.w = ea, eb, tau, ea.shape[-2]

    @staticmethod
    def of(a, w):
        """The decays of gates a [H, M, C, D] in blocks of w, or of the widest narrower w
        within LIMIT."""
        while True:
            one = torch.ones(w, w, dtype=a.dtype, device=a.device)
            beta = torch.matmul(one.triu(1), a.unflatten(-2, (-1, w)))
            if w == 1 or float(beta[..., 0, :].abs().amax()) <= LIMIT:
                break
            w //= 2
        alpha = torch.matmul(one.tril(), a.unflatten(-2, (-1, w)))
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


def _cross(R, Z, w):
    """Gate gradient inside each chunk: sum of R over i >= t plus sum of Z over j < t, for
    R, Z [.., C, D] (triangular matmuls in w-blocks, then whole blocks)."""
    one = torch.ones(w, w, dtype=R.dtype, device=R.device)
    R, Z = R.unflatten(-2, (-1, w)), Z.unflatten(-2, (-1, w))
    y = torch.matmul(one.triu(), R).add_(torch.matmul(one.tril(-1), Z))
    y += (_excl_cumsum(R.sum(-2), -2, reverse=True) + _excl_cumsum(Z.sum(-2), -2)).unsqueeze(-2)
    return y.flatten(-3, -2)


class _Chunked(torch.autograd.Function):
    """The recurrence on slot-layout tensors, forward and backward by hand.

    q [H,M,C,K] (scaled), k [H,M,C,K], v [H,M,C,V], a [H,M,C,K|1] or None, b [H,M,C,V] or
    None, h0 [H,N,K,V] in rank order. Returns o [H,M,C,V] and the final states [H,N,K,V]
    (rank order). Zero padding tokens (gate 0) leave the state unchanged.

    Gate gradients use d/dA_i = q_i dq_i - k_i dk_i (A_i: gates summed through i), summed
    over i >= t, but with every pair that does not straddle t left out analytically (the
    token's own k_i v_i term and the update's keys after t): what remains is only decayed
    terms, so strong gates give small gradients with small absolute errors.
    """

    @staticmethod
    def forward(ctx, q, k, v, a, b, h0, cnt):
        o, fin, _, saved, (w, levels) = _forward(q, k, v, a, b, h0, cnt)
        ctx.w, ctx.levels, ctx.cnt = w, levels, cnt
        ctx.save_for_backward(*saved)
        return o, fin

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dfin):
        q, k, v, qa, kb, qc, vb, qi, ku, vu, Pd, Pii, starts, o, *rest = ctx.saved_tensors
        w, levels, cnt = ctx.w, ctx.levels, ctx.cnt
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
            dq_d = _blk(dq_d.flatten(-3, -2), A.eb, w, div=True, inplace=True)
            dq = _blk(dq, A.ea, w, inplace=True).add_(dq_d)
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
            da = _cross(R, Z, w).add_(E.unsqueeze(-2))
        if B.ea is not None:
            R = (do * o).addcmul_(v, dv, value=-1)
            db = _cross(R, v * dv_u, w).add_(GS.sum(-2).unsqueeze(-2))
        dk, dv = dk.add_(dk_u), dv.add_(dv_u)
        if A.ea is not None:
            dPii = (do * v).sum(-1, keepdim=True)
            dq, dk = dq.addcmul_(dPii, k), dk.addcmul_(dPii, q)
        if B.ea is not None:
            dv = dv.addcmul_(Pii, do)
        return dq, dk, dv, da, db, dh0, None


def _forward(q, k, v, a, b, h0, cnt, after=0):
    """_Chunked's forward on slot-layout tensors (see there). `after`: how many sequences
    go on past these steps (a slab of a longer run; their states come back as `carry`
    [H, after, K, V] and are not among the final states). Returns (o, final states,
    carry, the tensors the backward reads, (w, levels))."""
    C, w = q.shape[-2], min(SUB, q.shape[-2])
    A = _Side.of(a, w) if a is not None else _NoSide()
    B = _Side.of(b, min(A.w, w)) if b is not None else _NoSide()
    if a is not None and A.w > B.w:  # the value side needed narrower blocks
        A = _Side.of(a, B.w)
    w = min(A.w, B.w, w)
    levels = [w << i for i in range((C // w).bit_length() - 1)]
    blocks = lambda x: x.unflatten(-2, (-1, w))

    qa, kb, vb = _blk(q, A.ea, w), _blk(k, A.eb, w), _blk(v, B.eb, w)
    qc = _blk(q, A.eb, w, div=True)
    # diagonal blocks, referenced at the block end; with value gates each token's own term
    # (j = i) apart, for their gradient (see the class docstring)
    Pd = _mm(blocks(qc), blocks(kb).mT).tril_(-1 if b is not None else 0)
    Pii = (q * k).sum(-1, keepdim=True) if b is not None else None
    yd = _mm(Pd, blocks(vb))
    # right halves of 2s-segments against their left halves, referenced at the midpoint
    Ps, ys = [], []
    for s in levels:
        qs, ks = A.at(_part(qa, s, 1), s, 1), A.at(_part(kb, s, 0), s, 0)
        Ps.append(_mm(qs, ks.mT))
        ys.append(_mm(Ps[-1], B.at(_part(vb, s, 0), s, 0)))
    # chunk updates and the state recurrence
    qi, ku, vu = A.chunk(qa, 1), A.chunk(kb, 0), B.chunk(vb, 0)
    starts, fin, carry = _recur(_mm(ku.mT, vu), _decay(A, B), h0, cnt, after)
    o = B.chunk(_mm(qi, starts), 1, inplace=True)
    for s, y in zip(levels, ys):
        _part(o, s, 1).add_(B.at(y, s, 1, inplace=True))
    if B.eb is not None:
        yd = _blk(yd.flatten(-3, -2), B.eb, w, div=True, inplace=True)
        o = _blk(o, B.ea, w, inplace=True).add_(yd)
    else:
        blocks(o).add_(yd)
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


def recurrent_native(plan, q, k, v, g=None, gk=None, gv=None, g_gamma=None, initial_state=None,
                     cu_seqlens=None, chunk_size=64):
    """SPEC.md's recurrence, chunked. Returns (o [B,T,H,V] in q's dtype, final_state
    [N,H,K,V] float32; float64 for float64 q).

    Batched layout as `plan` (bridge.contract.Plan) describes: q [B,T,H,K], k [B,T,Hk,K],
    v [B,T,Hk,V], g [B,T,H] or [B,T,H,K], gk [B,T,H,K], gv [B,T,H,V], g_gamma [H] or [N,H],
    initial_state [N,H,K,V]; with cu_seqlens [N+1], B == 1. chunk_size: a power of two.
    """
    if chunk_size < 1 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size: expected a power of two, got {chunk_size}")
    B, T, H, Hk, K, V, N = plan.B, plan.T, plan.H, plan.Hk, plan.K, plan.V, plan.N
    L, out_dtype, dev = B * T, q.dtype, q.device
    cd = torch.float64 if q.dtype == torch.float64 else torch.float32
    inputs = (q, k, v, g, gk, gv, g_gamma, initial_state)
    graph = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in inputs)
    if not graph and cu_seqlens is None and 0 < T <= STEP_T:
        return _steps(plan, cd, *inputs)
    cu = tuple(b * T for b in range(B + 1)) if cu_seqlens is None else tuple(cu_seqlens.tolist())
    longest = max(e - s for s, e in zip(cu, cu[1:]))
    C = min(chunk_size, 1 << max(longest - 1, 0).bit_length())
    tab = _table(cu, C, plan.reverse)
    if tab["tok"].device != dev:
        tab = {n: x.to(dev) if torch.is_tensor(x) else x for n, x in tab.items()}
    M = tab["M"]

    if M == 0:  # every sequence is empty; the zero keeps every input in the graph
        zero = sum(x.sum() for x in (q, k, v, g, gk, gv, g_gamma) if x is not None) * 0
        fin = torch.zeros(N, H, K, V, dtype=cd, device=dev) if initial_state is None \
            else initial_state.to(cd)
        return q.new_zeros(B, T, H, V) + zero.to(out_dtype), fin + zero.to(cd)

    if not graph:
        return _streamed(plan, tab, C, cd, *inputs)

    def chunks(x, scale=1.0):
        """[B,T,h,D] -> [h, M, C, D] in the compute dtype."""
        return _Relayout.apply(x.reshape(L, *x.shape[2:]), tab, C, True, scale).to(cd)

    q, k, v = chunks(q, plan.scale), chunks(k), chunks(v)
    if Hk != H:  # query head h reads kv head h // (H // Hk)
        k, v = (x.unsqueeze(1).expand(Hk, H // Hk, *x.shape[1:]).flatten(0, 1) for x in (k, v))
    parts = []
    if g is not None:
        parts.append(chunks(g.unsqueeze(-1) if plan.g == "head" else g))
    if gk is not None:
        parts.append(chunks(gk))
    if g_gamma is not None:  # per head [H] or per sequence [N, H]; 0 at padding
        gam = g_gamma.to(cd)
        gam = gam[:, None] if gam.dim() == 1 else gam.t().index_select(1, tab["seq"])
        gam = gam[..., None, None]
        parts.append(gam * tab["mask"] if tab["mask"] is not None else gam.expand(H, M, C, 1))
    a = functools.reduce(torch.add, parts) if parts else None
    b = chunks(gv) if gv is not None else None
    if initial_state is not None:  # [H, N, K, V] in rank order
        h0 = initial_state.to(cd).transpose(0, 1).index_select(1, tab["order"])
    else:
        h0 = torch.zeros(H, N, K, V, dtype=cd, device=dev)

    o, fin = _Chunked.apply(q, k, v, a, b, h0, tab["cnt"])
    o = _Relayout.apply(o, tab, C, False).view(B, T, H, V).to(out_dtype)
    return o, fin.index_select(1, tab["unorder"]).transpose(0, 1).contiguous()


def _steps(plan, cd, q, k, v, g, gk, gv, g_gamma, initial_state):
    """Decoding (a few tokens a row, no cu_seqlens, no autograd): the recurrence itself,
    S <- e^{a_t} S e^{b_t} + k_t^T v_t and o_t = scale q_t S, one step a token on the
    [B, H, K, V] state in place; no chunks, no tables."""
    B, T, H, Hk, K, V = plan.B, plan.T, plan.H, plan.Hk, plan.K, plan.V
    S = (initial_state.to(cd, copy=True) if initial_state is not None
         else torch.zeros(B, H, K, V, dtype=cd, device=q.device))
    o = torch.empty(B, T, H, V, dtype=q.dtype, device=q.device)
    gam = None if g_gamma is None else g_gamma.to(cd).expand(B, H).unsqueeze(-1)
    col = lambda x, t: x[:, t].to(cd)
    for t in (reversed(range(T)) if plan.reverse else range(T)):
        a = [col(g, t).unsqueeze(-1) if plan.g == "head" else col(g, t)] if g is not None else []
        a += [col(gk, t)] if gk is not None else []
        a += [gam] if gam is not None else []
        if a:  # (views of the inputs: nothing here is in place but S)
            S.mul_(functools.reduce(torch.add, a).exp().unsqueeze(-1))
        if gv is not None:
            S.mul_(col(gv, t).exp().unsqueeze(-2))
        kt, vt = col(k, t), col(v, t)
        if Hk != H:  # query head h reads kv head h // (H // Hk)
            kt, vt = kt.repeat_interleave(H // Hk, 1), vt.repeat_interleave(H // Hk, 1)
        S.view(B * H, K, V).baddbmm_(kt.reshape(B * H, K, 1), vt.reshape(B * H, 1, V))
        o[:, t] = torch.matmul((col(q, t) * plan.scale).unsqueeze(-2), S).squeeze(-2).to(o.dtype)
    return o, S


def _streamed(plan, tab, C, cd, q, k, v, g, gk, gv, g_gamma, initial_state):
    """recurrent_native without autograd, a slab of chunk steps at a time: the slab's
    tokens are gathered straight from the inputs and its output written straight into
    o, so besides o and the final states only one slab's inputs and temporaries (a few
    tens of SLAB elements) are alive."""
    B, T, H, Hk, K, V, N = plan.B, plan.T, plan.H, plan.Hk, plan.K, plan.V, plan.N
    L, M, cnt, mask = B * T, tab["M"], tab["cnt"], tab["mask"]
    offs = np.cumsum([0] + cnt).tolist()
    tok = tab["tok"].view(M, C)
    per_slot = H * C * max(K, V)
    budget = min(SLAB, max(SLAB // 4, L * H * V // 16))
    if plan.g == "head":
        g = g.unsqueeze(-1)
    gam = None
    if g_gamma is not None:  # [H, 1] per head or [H, N] per sequence
        gam = g_gamma.to(cd)
        gam = gam[:, None] if gam.dim() == 1 else gam.t()
    flat = lambda x: None if x is None else x.reshape(L, *x.shape[2:])
    q, k, v, g, gk, gv = map(flat, (q, k, v, g, gk, gv))
    o = torch.empty(L, H, V, dtype=q.dtype, device=q.device)
    if initial_state is not None:  # [H, N, K, V] in rank order
        state = initial_state.to(cd).transpose(0, 1).index_select(1, tab["order"])
    else:
        state = torch.zeros(H, N, K, V, dtype=cd, device=q.device)
    finals, c0 = [], 0
    while c0 < len(cnt):
        c1 = c0 + 1  # as many steps as fit the budget, at least one
        while c1 < len(cnt) and (offs[c1 + 1] - offs[c0]) * per_slot <= budget:
            c1 += 1
        r0, r1 = offs[c0], offs[c1]
        idx, keep = tok[r0:r1].reshape(-1), None if mask is None else mask[r0:r1]

        def chunks(x, scale=1.0):
            """[L, h, D] -> this slab's [h, m, C, D] in the compute dtype, 0 at padding."""
            y = x.index_select(0, idx).view(r1 - r0, C, *x.shape[1:]).permute(2, 0, 1, 3)
            y = y.to(cd, memory_format=torch.contiguous_format, copy=True)
            y = y.mul_(scale) if scale != 1.0 else y
            return y if keep is None else y.mul_(keep)

        cq, ck, cv = chunks(q, plan.scale), chunks(k), chunks(v)
        if Hk != H:  # query head h reads kv head h // (H // Hk)
            ck, cv = (x.unsqueeze(1).expand(Hk, H // Hk, *x.shape[1:]).flatten(0, 1)
                      for x in (ck, cv))
        parts = [chunks(x) for x in (g, gk) if x is not None]
        if gam is not None:
            gs = gam if gam.shape[1] == 1 else gam.index_select(1, tab["seq"][r0:r1])
            gs = gs[..., None, None]
            parts.append(gs * keep if keep is not None else gs.expand(H, r1 - r0, C, 1))
        a = functools.reduce(torch.add, parts) if parts else None
        after = cnt[c1] if c1 < len(cnt) else 0
        y, fin, state, _, _ = _forward(cq, ck, cv, a, chunks(gv) if gv is not None else None,
                                       state, cnt[c0:c1], after)
        finals.append(fin)
        y = y.permute(1, 2, 0, 3).reshape(-1, H, V).to(o.dtype)
        if keep is None:
            o.index_copy_(0, idx, y)
        else:
            sel = keep.reshape(-1)
            o.index_copy_(0, idx[sel], y[sel])
        c0 = c1
    fin = torch.cat(finals[::-1], 1)  # rank order: each slab ends the sequences after it
    return o.view(B, T, H, V), fin.index_select(1, tab["unorder"]).transpose(0, 1).contiguous()


def recurrent_native_backward(plan, inputs, cu_seqlens, do, dfinal_state, chunk_size=64):
    """Gradients of the present inputs (q, k, v, g, gk, gv, g_gamma, initial_state order,
    absent ones None in `inputs`), each in its input's dtype and shape; `do` [B,T,H,V] and
    `dfinal_state` [N,H,K,V] may be None. The forward is recomputed under autograd (its
    saved tensors depend on the gate values, so they cannot leave an op whose outputs
    need fixed shapes); the hand-written backward above then runs once."""
    present = [x for x in inputs if x is not None]
    # an op's kernel runs below autograd (its dispatch keys excluded): switch them back on
    C = torch._C
    below = C._dispatch_tls_local_exclude_set()
    below = below.remove(C.DispatchKey.AutogradFunctionality)
    with C._ForceDispatchKeyGuard(C._dispatch_tls_local_include_set(), below), \
            torch.enable_grad():
        leaves = [x.detach().requires_grad_() for x in present]
        it = iter(leaves)
        q, k, v, g, gk, gv, g_gamma, h0 = (None if x is None else next(it) for x in inputs)
        o, fin = recurrent_native(plan, q, k, v, g=g, gk=gk, gv=gv, g_gamma=g_gamma,
                                  initial_state=h0, cu_seqlens=cu_seqlens,
                                  chunk_size=chunk_size)
        outs = [(y, dy) for y, dy in ((o, do), (fin, dfinal_state)) if dy is not None]
        if not outs:
            return [torch.zeros_like(x) for x in present]
        got = torch.autograd.grad([y for y, _ in outs], leaves, [dy.to(y.dtype) for y, dy in outs],
                                  allow_unused=True)
    return [torch.zeros_like(x) if d is None else d.to(x.dtype) for x, d in zip(present, got)]
