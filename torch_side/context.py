"""Context parallelism over torch.distributed: the time axis of one call split across the
ranks of a process group (SPEC.md, "Context parallelism over torch.distributed"), the
algorithm of SPEC.md's "Context parallelism" in its names (bridge/context.py lists them
and holds the framework-neutral steps); jax_side/context.py is the JAX twin.

Rank p of P holds the p-th contiguous slice of the time axis (with `cu_seqlens`, the
global packed offsets, every slice has the same length T). The combine accumulates in
float32 (float64 on the float64 torch path).

Backward: autograd through steps 1, 2 and 5; the exchange (steps 3-4, `_Exchange`) has
its own backward: ONE all_gather of (dS_in, dfinal_state) from every rank and a suffix
combine. Cotangents of the final state from several ranks add up. Inputs every rank
holds whole (`initial_state`, `g_gamma`) get this rank's share of their gradient: summed
over the group (as DDP does for parameters) they give the single-process gradient. Every
rank of the group must make the call and run the backward (collectives).
"""

import torch
import torch.distributed as dist

from bridge import context as combine


def group_size_rank(group):
    """(P, p): ranks in `group` and this process's rank in it; TypeError unless a
    ProcessGroup."""
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"context_group: expected a torch.distributed.ProcessGroup, "
                        f"got {type(group).__name__}")
    return dist.get_world_size(group), dist.get_rank(group)


def all_gather(x, group):
    """[P, *x.shape]: x from every rank of `group`, in rank order (one collective)."""
    P = dist.get_world_size(group)
    out = x.new_empty(P * x.numel())
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, x.contiguous().reshape(-1), group=group)
    return out.view(P, *x.shape)


class _Exchange(torch.autograd.Function):
    """Steps 3 and 4: (F, A, B) of this rank -> (S_in of this rank, final_state)."""

    @staticmethod
    def forward(ctx, F, A, B, group, order):
        P, p = dist.get_world_size(group), dist.get_rank(group)
        sizes = [F.numel(), A.numel(), B.numel()]
        gathered = all_gather(torch.cat([F.reshape(-1), A.reshape(-1), B.reshape(-1)]), group)
        Fs, As, Bs = (x.view(P, *like.shape)
                      for x, like in zip(gathered.split(sizes, dim=1), (F, A, B)))
        E = As.exp().unsqueeze(-1) * Bs.exp().unsqueeze(-2)  # the diagonal transitions
        S_in, final_state = combine.prefix_combine(Fs, lambda j, S: E[j] * S, order,
                                                   torch.zeros_like(F))
        ctx.save_for_backward(E, S_in[p])
        ctx.group, ctx.order = group, order
        return S_in[p], final_state

    @staticmethod
    def backward(ctx, dS_in, dfinal_state):
        E, S_in = ctx.saved_tensors
        group, order = ctx.group, ctx.order
        p = dist.get_rank(group)
        gathered = all_gather(torch.stack([dS_in, dfinal_state]), group)
        dS = gathered[:, 1].sum(0)  # the final state's cotangents from every rank add up
        for j in reversed(order[order.index(p) + 1:]):  # suffix combine down to this rank
            dS = gathered[j, 0] + E[j] * dS
        dE = dS * S_in * E[p]
        return dS, dE.sum(-1), dE.sum(-2), None, None


def _edge_cumsum(x, reverse):
    """Inclusive sums along time (dim 1) from the slice's entry edge."""
    return x.flip(1).cumsum(1).flip(1) if reverse else x.cumsum(1)


def _slice_sums(c, lo, hi, reverse):
    """Each sequence's total over local tokens [lo, hi) from the entry-edge sums `c`
    [B,T,H,D]: exact for the sequence at the entry edge (the one whose total matters:
    only it carries a state in)."""
    pad = c.new_zeros(c.shape[0], 1, *c.shape[2:])
    if reverse:
        z = torch.cat([c, pad], 1)
        return z.index_select(1, lo) - z.index_select(1, hi)
    z = torch.cat([pad, c], 1)
    return z.index_select(1, hi) - z.index_select(1, lo)


def _key_decay(g, gk, g_gamma, seq, lead, dtype):
    """a_t = g_t + gk_t + g_gamma, [B,T,H,1 or K] in `dtype` (None without key gates);
    `seq` [T]: each token's sequence with cu_seqlens (for g_gamma [N, H])."""
    parts = []
    if g is not None:
        parts.append((g.unsqueeze(-1) if g.dim() == 3 else g).to(dtype))
    if gk is not None:
        parts.append(gk.to(dtype))
    if g_gamma is not None:
        gam = g_gamma.to(dtype)
        if gam.dim() == 1:
            gam = gam.view(1, 1, -1, 1)
        elif seq is None:
            gam = gam[:, None, :, None]
        else:
            gam = gam.index_select(0, seq.clamp(0, gam.shape[0] - 1))[None, :, :, None]
        parts.append(gam.expand(*lead, 1))
    return sum(parts[1:], parts[0]) if parts else None


def context_parallel(local, group, inputs, cu_seqlens, scale, reverse):
    """One call of SPEC.md's recurrence with the time axis split over `group`.

    `inputs` by name (`bridge.grads.INPUTS`, absent ones None): this rank's slice in the
    batched layout, q [B,T,H,K], k [B,T,Hk,K], v [B,T,Hk,V], g [B,T,H(,K)], gk [B,T,H,K],
    gv [B,T,H,V]; the whole g_gamma [H] or [N,H] and initial_state [N,H,K,V]. cu_seqlens:
    the global packed offsets [N+1] (B = 1, every rank T tokens) or None.
    `local(inputs, cu_seqlens)` runs one slice and returns (o [B,T,H,V], final_state
    [N,H,K,V]).
    Returns (o [B,T,H,V] in q's dtype, final_state [N,H,K,V], the same on every rank).
    """
    P, p = group_size_rank(group)
    q, v, g, gk, gv, g_gamma, initial_state = (inputs[n] for n in (
        "q", "v", "g", "gk", "gv", "g_gamma", "initial_state"))
    lead, (T, H, K) = q.shape[:3], q.shape[1:]
    V, dev = v.shape[-1], q.device
    order = combine.visiting_order(P, reverse)

    # 1. the local pass; initial_state[n] enters on the rank of n's first processed token
    if cu_seqlens is None:
        N = q.shape[0]
        starts_here = torch.tensor(p == order[0], device=dev)
        lo = torch.zeros(1, dtype=torch.long, device=dev)
        hi = torch.full((1,), T, dtype=torch.long, device=dev)
        cu_local = seq = None
    else:
        N = cu_seqlens.shape[0] - 1
        cu = cu_seqlens.long()
        starts_here = (combine.first_device(cu, T, P, reverse) == p)[:, None, None, None]
        cu_local = combine.local_offsets(cu, T, p)
        lo, hi = cu_local[:-1], cu_local[1:]
        seq = torch.searchsorted(cu_local, torch.arange(T, device=dev), right=True) - 1
        cu_local = cu_local.to(cu_seqlens.dtype)
    h0 = None if initial_state is None else torch.where(starts_here, initial_state, 0)
    o_loc, F = local(dict(inputs, initial_state=h0), cu_local)
    # the combine and the correction accumulate in acc: autocast must not downcast them
    with torch.autocast(q.device.type, enabled=False):
        acc = F.dtype  # float32, or float64 on the float64 torch path

        # 2. each sequence's summed log decays over the slice
        a = _key_decay(g, gk, g_gamma, seq, lead, acc)
        b = None if gv is None else gv.to(acc)
        ca = None if a is None else _edge_cumsum(a, reverse)
        cb = None if b is None else _edge_cumsum(b, reverse)
        A = F.new_zeros(N, H, K) if a is None else \
            _slice_sums(ca, lo, hi, reverse).reshape(-1, H, ca.shape[-1]).expand(N, H, K)
        B = F.new_zeros(N, H, V) if b is None else \
            _slice_sums(cb, lo, hi, reverse).reshape(-1, H, V)

        # 3-4. the exchange and the prefix combine
        S_in, final_state = _Exchange.apply(F, A, B, group, order)

        # 5. the correction of the sequence at the entry edge, n0 (the only one with a
        # state coming in)
        qa = q.to(acc) if ca is None else q.to(acc) * ca.exp()
        if seq is None:
            S_n0 = S_in
        else:
            n0 = seq[-1:] if reverse else seq[:1]
            if T == 0:
                n0 = torch.zeros(1, dtype=torch.long, device=dev)
            S_n0 = S_in.index_select(0, n0.clamp(0, N - 1))
            qa = torch.where((seq == n0)[None, :, None, None], qa, 0)
        corr = torch.einsum("bthk,bhkv->bthv", qa, S_n0) * scale
        if cb is not None:
            corr = corr * cb.exp()
        return (o_loc.to(acc) + corr).to(o_loc.dtype), final_state
