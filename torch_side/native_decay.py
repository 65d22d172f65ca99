"""Log-decay factors of the chunked torch path in w-blocks of each chunk, every exponent a
sum of the gates it spans, never a difference of long running sums (which cancel and
lose ~10x with strong gates).

The decay between tokens j <= i of a chunk is exp(gates summed over (j, i]). The chunk is
cut into w-blocks; pairs in different blocks are handled level by level (right half of
each 2h-segment against its left half, h = w .. C/2), both factors referenced at the
segment midpoint, so both are exp(<= 0). Inside a w-block the factors are referenced at
the block end (queries get exp(> 0)); w <= config.widest_block is the widest block whose
in-block gate sums stay within config.log_decay_limit, so nothing overflows and in-block
cancellation costs at most limit * eps (w = 1 always qualifies). Moderate gates (|sum|
within the limit over a chunk) make the whole chunk one block: no levels, and every
in-chunk product is one C x C matmul.
"""

from __future__ import annotations

import torch


def exclusive_cumsum(x, dim, reverse=False):
    """Sum of the entries strictly before (after, with reverse) each position along dim,
    accumulated from the entries themselves."""
    n = x.shape[dim]
    zero = torch.zeros_like(x.narrow(dim, 0, 1))
    if n == 1:
        return zero
    if reverse:
        return torch.cat([x.narrow(dim, 1, n - 1).flip(dim).cumsum(dim).flip(dim), zero], dim)
    return torch.cat([zero, x.narrow(dim, 0, n - 1).cumsum(dim)], dim)


def segment_half(x, s, side):
    """[.., C, D] -> [.., S, s, D]: the right (side 1) or left (0) halves of the 2s-segments,
    or, when s == C, the whole chunk [.., 1, C, D]."""
    if x.shape[-2] == s:
        return x.unsqueeze(-3)
    return x.unflatten(-2, (-1, 2, s)).select(-3, side)


def scale_blocks(x, e, w, divide=False, inplace=False):
    """x [.., C, D] times (or divided by) the per-block tensor e [.., C/w, w, D]; None = 1."""
    if e is None:
        return x
    xb = x.unflatten(-2, (-1, w))
    if inplace:
        (xb.div_ if divide else xb.mul_)(e)
        return x
    return (xb / e if divide else xb * e).flatten(-3, -2)


class BlockDecay:
    """Log decays of one side (keys: a over K; values: b over V) in w-blocks of each chunk.

    a [H, M, C, D], D = 1 for one scalar per head and step. e_into / e_out
    [H, M, C/w, w, D]: exp of a summed from the block start through t / after t to the
    block end; log_totals [H, M, C/w, D] the block totals. Every exponent is a sum of gates
    (triangular matmuls over config.triangle-pieces plus the totals of whole pieces),
    never a difference of sums. width: the widest block (<= config.widest_block) whose
    in-block sums stay within config.log_decay_limit.
    """

    def __init__(self, e_into, e_out, log_totals, width=None):
        self.e_into, self.e_out, self.log_totals = e_into, e_out, log_totals
        self.width = e_out.shape[-2] if width is None else width

    @staticmethod
    def of(a, w, config, updates_only=False):
        """The decays of gates a [H, M, C, D] in blocks of w, or of the widest narrower w
        within config.log_decay_limit. updates_only: without e_into (None), which only the
        queries read."""
        limit = config.log_decay_limit
        s = min(w, config.triangle)
        x = a.unflatten(-2, (-1, s))
        if w > s:  # blocks of whole triangle-pieces, judged by their sums of |gates|
            tot, mag = x.sum(-2), x.abs().sum(-2)  # [H, M, C/s, D]
            while w > s and float(mag.unflatten(-2, (-1, w // s)).sum(-2).amax()) > limit:
                w //= 2
        while True:
            one = torch.ones(s, s, dtype=a.dtype, device=a.device)
            beta = torch.matmul(one.triu(1), x)
            if w > s or s == 1 or float(beta[..., 0, :].abs().amax()) <= limit:
                break
            w = s = s // 2
            x = a.unflatten(-2, (-1, s))
        alpha = None if updates_only else torch.matmul(one.tril(), x)
        if w > s:  # the pieces before (alpha) and after (beta) in the block
            tot = tot.unflatten(-2, (-1, w // s))
            beta = beta.unflatten(-3, (-1, w // s)).add_(
                exclusive_cumsum(tot, -2, reverse=True).unsqueeze(-2)).flatten(-3, -2)
            if alpha is not None:
                alpha = alpha.unflatten(-3, (-1, w // s)).add_(
                    exclusive_cumsum(tot, -2).unsqueeze(-2)).flatten(-3, -2)
        if updates_only:
            log_totals = tot.sum(-2) if w > s else x.sum(-2)
            return BlockDecay(None, beta.exp_(), log_totals, w)
        log_totals = alpha[..., -1, :].clone()
        return BlockDecay(alpha.exp_(), beta.exp_(), log_totals)

    def to_segment(self, xs, s, side, inplace=False):
        """xs [.., S, s, D] (a segment_half) times exp of the whole blocks between each
        token's block and its segment's start (side 1, rows) or end (side 0, columns)."""
        nb = s // self.width
        if nb == 1:
            return xs
        f = exclusive_cumsum(segment_half(self.log_totals, nb, side), -2,
                             reverse=side == 0).exp().unsqueeze(-2)
        if inplace:
            xs.unflatten(-2, (nb, self.width)).mul_(f)
            return xs
        return (xs.unflatten(-2, (nb, self.width)) * f).flatten(-3, -2)

    def to_chunk(self, x, side, inplace=False):
        """x [.., C, D] decayed from the chunk start (side 1) or to the chunk end (side 0)."""
        return self.to_segment(x.unsqueeze(-3), x.shape[-2], side, inplace)[..., 0, :, :]

    def chunk_total(self):
        """exp of the chunk's whole decay [H, M, D]."""
        return self.log_totals.sum(-2).exp()


class NoDecay:
    """An absent side: every factor is 1; any block width suits it."""
    e_into = e_out = log_totals = None

    def __init__(self, width):
        self.width = width

    def to_segment(self, xs, s, side, inplace=False):
        return xs

    def to_chunk(self, x, side, inplace=False):
        return x

    def chunk_total(self):
        return None


def block_decays(a, b, C, config, updates_only=False):
    """The decays of key gates a and value gates b [H, M, C, D] (or None) in w-blocks of
    one common width w, and the levels (segment halves w .. C/2): (A, B, w, levels).
    updates_only: only what the state updates read (see BlockDecay.of)."""
    w = min(config.widest_block, C)
    A = BlockDecay.of(a, w, config, updates_only) if a is not None else NoDecay(
        config.widest_block)
    B = BlockDecay.of(b, min(A.width, w), config, updates_only) if b is not None else NoDecay(
        config.widest_block)
    if a is not None and A.width > B.width:  # the value side needed narrower blocks
        A = BlockDecay.of(a, B.width, config, updates_only)
    w = min(A.width, B.width, w)
    return A, B, w, [w << i for i in range((C // w).bit_length() - 1)]


def state_decay(A, B):
    """Chunk decay of the state, broadcastable to [H, M, K, V], or None."""
    da, db = A.chunk_total(), B.chunk_total()
    if da is None:
        return None if db is None else db.unsqueeze(-2)
    return da.unsqueeze(-1) if db is None else da.unsqueeze(-1) * db.unsqueeze(-2)
