"""The chunk algebra of the torch path on slot-layout tensors [H, M, C, D] (M chunk slots,
see native_layout): the forward and its hand-written backward inside chunks (batched
matmuls over the slots, decays from native_decay), and the K x V state recurrence over
chunk steps with its adjoint, one step per chunk position over the sequences still
active there (`active[c]`: the sequences active at step c, ranks [0, active[c]))."""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np
import torch

from .native_decay import (BlockDecay, NoDecay, block_decays, exclusive_cumsum, scale_blocks,
                           segment_half, state_decay)


def bmm(a, b):
    """Batched matmul over matching leading dims, through 3-d views so that transposed
    operands reach BLAS as flags rather than as copies."""
    lead = a.shape[:-2]
    return torch.bmm(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:])).view(
        *lead, a.shape[-2], b.shape[-1])


class ChunkKept(NamedTuple):
    """What chunk_forward keeps for chunk_backward, slot layout [H, M, C, D] unless said:
    the inputs q (scaled), k, v; q_from_block / k_to_block / v_to_block: decayed from the
    block start / to the block end; q_block_end: q referenced at its block end (divided by
    the decay to it); q_from_chunk: decayed from the chunk start; k_update, v_update:
    decayed to the chunk end; diag_weights [H, M, C/w, w, w]: the diagonal blocks' weights;
    own_weights [H, M, C, 1]: q_t . k_t (value gates only, else None); starts
    [H, M, K, V]: the states entering every chunk; o: the output before the own terms
    (value gates only, else None); key_decay, value_decay: the sides' decays; level_weights:
    each level's weights [H, M, C/2s, s, s]; width, levels: the block width and the
    segment halves w .. C/2."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_from_block: torch.Tensor
    k_to_block: torch.Tensor
    q_block_end: torch.Tensor
    v_to_block: torch.Tensor
    q_from_chunk: torch.Tensor
    k_update: torch.Tensor
    v_update: torch.Tensor
    diag_weights: torch.Tensor
    own_weights: Optional[torch.Tensor]
    starts: torch.Tensor
    o: Optional[torch.Tensor]
    key_decay: "BlockDecay | NoDecay"
    value_decay: "BlockDecay | NoDecay"
    level_weights: list
    width: int
    levels: list


def decayed_updates(k, v, A, B, w):
    """Keys and values decayed to their block end (kb, vb) and to their chunk end (ku, vu):
    each chunk adds ku^T vu to the state."""
    kb, vb = scale_blocks(k, A.e_out, w), scale_blocks(v, B.e_out, w)
    return kb, vb, A.to_chunk(kb, 0), B.to_chunk(vb, 0)


def chunk_forward(q, k, v, a, b, h0, active, config, after=0, out=True, keep=True,
                  starts=None):
    """The recurrence on slot-layout tensors: q [H,M,C,K] (scaled), k [H,M,C,K], v [H,M,C,V],
    a [H,M,C,K|1] or None, b [H,M,C,V] or None, h0 [H,N,K,V] in rank order, active the
    sequences active at each step. Zero padding tokens (gate 0) leave the state unchanged.
    `after`: how many sequences go on past these steps (a slab of a longer run; their
    states come back as `carry` [H, after, K, V] and are not among the final states).
    Returns (o [H,M,C,V], final states [H, N - after, K, V] (rank order), carry, a
    ChunkKept for chunk_backward (None with keep=False: each temporary goes when used));
    with out=False (a backward's recompute) o is None unless chunk_backward reads it
    (value gates). `starts`: the states entering every chunk [H,M,K,V] when known (a
    backward's recompute): then the recurrence is not run and the final states and carry
    are None."""
    A, B, w, levels = block_decays(a, b, q.shape[-2], config)
    blocks = lambda x: x.unflatten(-2, (-1, w))
    out = out or b is not None

    kb, vb, ku, vu = decayed_updates(k, v, A, B, w)
    # the state recurrence first: its [K, V]-per-chunk arrays go before the in-chunk ones come
    fin = carry = None
    if starts is None:
        U = bmm(ku.mT, vu)
        if not keep:
            del ku, vu
        starts, fin, carry = state_recurrence(U, state_decay(A, B), h0, active, after)
        del U
    qa, qc = scale_blocks(q, A.e_into, w), scale_blocks(q, A.e_out, w, divide=True)
    qi = A.to_chunk(qa, 1)
    o = B.to_chunk(bmm(qi, starts), 1, inplace=True) if out else None
    if not keep:
        del qi, starts
    # diagonal blocks, referenced at the block end; with value gates each token's own term
    # (j = i) apart, for their gradient (see chunk_backward)
    Pd = bmm(blocks(qc), blocks(kb).mT).tril_(-1 if b is not None else 0)
    Pii = (q * k).sum(-1, keepdim=True) if b is not None else None
    # right halves of 2s-segments against their left halves, referenced at the midpoint
    Ps = []
    for s in levels:
        qs, ks = A.to_segment(segment_half(qa, s, 1), s, 1), A.to_segment(
            segment_half(kb, s, 0), s, 0)
        P = bmm(qs, ks.mT)
        del qs, ks
        if out:
            y = bmm(P, B.to_segment(segment_half(vb, s, 0), s, 0))
            segment_half(o, s, 1).add_(B.to_segment(y, s, 1, inplace=True))
            del y
        if keep:
            Ps.append(P)
        del P
    if out:
        yd = bmm(Pd, blocks(vb))
        if B.e_out is not None:
            yd = scale_blocks(yd.flatten(-3, -2), B.e_out, w, divide=True, inplace=True)
            o = scale_blocks(o, B.e_into, w, inplace=True).add_(yd)
        else:
            blocks(o).add_(yd)
        del yd
    kept = None
    if keep:
        kept = ChunkKept(q, k, v, q_from_block=qa, k_to_block=kb, q_block_end=qc, v_to_block=vb,
                         q_from_chunk=qi, k_update=ku, v_update=vu, diag_weights=Pd,
                         own_weights=Pii, starts=starts, o=o if b is not None else None,
                         key_decay=A, value_decay=B, level_weights=Ps, width=w, levels=levels)
    return (torch.addcmul(o, Pii, v) if b is not None else o), fin, carry, kept


def gate_gradient_sums(R, Z, triangle):
    """Gate gradient inside each chunk: sum of R over i >= t plus sum of Z over j < t, for
    R, Z [.., C, D] (triangular matmuls in w-blocks, w <= triangle, then whole blocks)."""
    w = min(triangle, R.shape[-2])
    one = torch.ones(w, w, dtype=R.dtype, device=R.device)
    R, Z = R.unflatten(-2, (-1, w)), Z.unflatten(-2, (-1, w))
    y = torch.matmul(one.triu(), R).add_(torch.matmul(one.tril(-1), Z))
    y += (exclusive_cumsum(R.sum(-2), -2, reverse=True)
          + exclusive_cumsum(Z.sum(-2), -2)).unsqueeze(-2)
    return y.flatten(-3, -2)


def chunk_backward(kept, active, do, dfin, config):
    """The gradients of chunk_forward's inputs from what it kept: (dq, dk, dv, da, db, dh0)
    on slot-layout tensors; do [H,M,C,V] the output's gradient (0 at padding), dfin the
    final states' [H,N,K,V] (rank order; for a slab, its carry's first, see chunk_forward).

    Gate gradients use d/dA_i = q_i dq_i - k_i dk_i (A_i: gates summed through i), summed
    over i >= t, but with every pair that does not straddle t left out analytically (the
    token's own k_i v_i term and the update's keys after t): what remains is only decayed
    terms, so strong gates give small gradients with small absolute errors.
    """
    q, k, v, o, starts = kept.q, kept.k, kept.v, kept.o, kept.starts
    qa, kb, qc, vb = kept.q_from_block, kept.k_to_block, kept.q_block_end, kept.v_to_block
    qi, ku, vu = kept.q_from_chunk, kept.k_update, kept.v_update
    Pd, Pii, A, B, w = kept.diag_weights, kept.own_weights, kept.key_decay, kept.value_decay, \
        kept.width
    blocks = lambda x: x.unflatten(-2, (-1, w))
    dod, doa = scale_blocks(do, B.e_out, w, True), scale_blocks(do, B.e_into, w)

    # diagonal blocks (with key gates, own terms apart)
    dP = bmm(blocks(dod), blocks(vb).mT).tril_(-1 if A.e_into is not None else 0)
    dq_d = bmm(dP, blocks(kb))
    dk, dv = bmm(dP.mT, blocks(qc)).flatten(-3, -2), bmm(Pd.mT, blocks(dod)).flatten(-3, -2)
    # chunk level: the state recurrence backwards; *_u: through the chunk updates
    doi = B.to_chunk(doa, 1)
    decay = state_decay(A, B)
    G, dh0 = state_recurrence_backward(bmm(qi.mT, doi), decay, dfin, active)
    dq = A.to_chunk(bmm(doi, starts.mT), 1, inplace=True)
    dk_u = scale_blocks(A.to_chunk(bmm(vu, G.mT), 0, inplace=True), A.e_out, w, inplace=True)
    dv_u = scale_blocks(B.to_chunk(bmm(ku, G), 0, inplace=True), B.e_out, w, inplace=True)
    # levels
    for s, P in zip(kept.levels, kept.level_weights):
        qs, ks = A.to_segment(segment_half(qa, s, 1), s, 1), A.to_segment(
            segment_half(kb, s, 0), s, 0)
        vs, dos = B.to_segment(segment_half(vb, s, 0), s, 0), B.to_segment(
            segment_half(doa, s, 1), s, 1)
        dP = bmm(dos, vs.mT)
        segment_half(dq, s, 1).add_(A.to_segment(bmm(dP, ks), s, 1, inplace=True))
        segment_half(dk, s, 0).add_(A.to_segment(bmm(dP.mT, qs), s, 0, inplace=True))
        segment_half(dv, s, 0).add_(B.to_segment(bmm(P.mT, dos), s, 0, inplace=True))
    if A.e_into is not None:
        dq = scale_blocks(dq, A.e_into, w, inplace=True)
        blocks(dq).addcdiv_(dq_d, A.e_out)
    else:
        blocks(dq).add_(dq_d)
    dk, dv = scale_blocks(dk, A.e_out, w, inplace=True), scale_blocks(dv, B.e_out, w,
                                                                      inplace=True)

    # gates: only pairs straddling t (see the docstring), plus the decayed entering state
    da = db = None
    if A.e_into is not None or B.e_into is not None:
        GS = G.mul_(starts) if decay is None else G.mul_(starts).mul_(decay)
    if A.e_into is not None:
        R, Z = (q * dq).addcmul_(k, dk, value=-1), k * dk_u
        if A.log_totals.shape[-1] == 1:
            R, Z = R.sum(-1, keepdim=True), Z.sum(-1, keepdim=True)
            E = GS.sum((-1, -2)).unsqueeze(-1)
        else:
            E = GS.sum(-1)
        da = gate_gradient_sums(R, Z, config.triangle).add_(E.unsqueeze(-2))
    if B.e_into is not None:
        R = (do * o).addcmul_(v, dv, value=-1)
        db = gate_gradient_sums(R, v * dv_u, config.triangle).add_(GS.sum(-2).unsqueeze(-2))
    dk, dv = dk.add_(dk_u), dv.add_(dv_u)
    if A.e_into is not None:
        dPii = (do * v).sum(-1, keepdim=True)
        dq, dk = dq.addcmul_(dPii, k), dk.addcmul_(dPii, q)
    if B.e_into is not None:
        dv = dv.addcmul_(Pii, do)
    return dq, dk, dv, da, db, dh0


def state_recurrence(U, decay, h0, active, after=0):
    """S <- decay * S + U over the chunk steps. U [H, M, K, V] in slot order, h0 [H, N, K, V]
    in rank order. Returns the states entering every chunk [H, M, K, V], the final
    states [H, N - after, K, V] (rank order) and the states of the `after` sequences still
    active past the last step [H, after, K, V] (a slab of a longer run)."""
    starts = torch.empty_like(U)
    starts[:, :active[0]] = h0[:, :active[0]]
    finals = [h0[:, active[0]:]]
    offs = np.cumsum([0] + active).tolist()
    carry = h0[:, :0]
    for c, n in enumerate(active):
        last = c + 1 == len(active)
        nxt = after if last else active[c + 1]
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


def state_recurrence_backward(Qt, decay, dfin, active):
    """The recurrence's adjoint: G [H, M, K, V], the gradient of the state leaving every chunk,
    and dh0 [H, N, K, V]; Qt [H, M, K, V] is each chunk's direct gradient of its entering state."""
    G = torch.empty_like(Qt)
    dh0 = dfin.clone()
    offs = np.cumsum([0] + active).tolist()
    for c in reversed(range(len(active))):
        n, nxt, off = active[c], active[c + 1] if c + 1 < len(active) else 0, offs[c]
        g = G[:, off:off + n]
        g[:, nxt:] = dfin[:, nxt:n]  # these sequences end with this chunk
        dst = G[:, offs[c - 1]:offs[c - 1] + n] if c else dh0[:, :n]
        if decay is None:
            torch.add(Qt[:, off:off + n], g, out=dst)
        else:
            torch.addcmul(Qt[:, off:off + n], decay[:, off:off + n], g, out=dst)
    return G, dh0
