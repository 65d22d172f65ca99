"""Context parallelism over torch.distributed: the time axis of one call split across the
ranks of a process group (SPEC.md, "Context parallelism over torch.distributed"); the
same algorithm as jax_side's `context_axis`, so both frameworks compute the same thing.

Rank i of the group holds the i-th contiguous slice of the time axis (with `cu_seqlens`,
the global packed offsets, every slice has the same length T). Each rank:

1. runs its slice through `local` (one gla_bridge op) from a zero state, except that a
   sequence's `initial_state` enters on the rank where the sequence starts ("owner"):
   o_loc, and L [N,H,K,V], the state its slice leaves;
2. sums each sequence's log decays over its slice, A [N,H,K] and B [N,H,V];
3. ONE all_gather of (L, A, B) (N*H*(K*V+K+V) numbers a rank, nothing of size T), then a
   prefix combine over the ranks in processing order, in float32 (float64 for the
   float64 torch path): S_0 = 0, S_{j+1} = exp(A_j) * S_j * exp(B_j) + L_j. A rank's
   incoming state is its S_j; the final state S_P is the same on every rank. A sequence
   absent from a slice has A = B = 0 and L = 0 there, so its state passes unchanged;
   one that has not started yet carries 0, which is the reset at a sequence start;
4. corrects o_loc with the incoming state, which only the sequence entering the slice
   from an earlier rank carries: o_t += scale * ((q_t * exp(A_t)) @ S_in) * exp(B_t),
   A_t, B_t the log decays summed from the slice edge to t (a product with the gated
   queries, not a second pass).

Backward: autograd through 1, 2 and 4; the exchange's own backward is ONE all_gather of
(dS_in, dfinal_state) from every rank and a suffix combine. Gradients of the final state
from several ranks add up. Inputs every rank holds whole (`initial_state`, `g_gamma`) get
this rank's share of their gradient: summed over the group (as DDP does for parameters)
they give the single-process gradient. Every rank of the group must make the call and
run the backward (collectives).
"""

import torch
import torch.distributed as dist


def group_size_rank(group):
    """(ranks in `group`, this process's rank in it); TypeError unless a ProcessGroup."""
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
    """(L, A, B) of this rank -> (S_in of this rank, final state); see the module doc."""

    @staticmethod
    def forward(ctx, L, A, B, group, order):
        P, me = dist.get_world_size(group), dist.get_rank(group)
        sizes = [L.numel(), A.numel(), B.numel()]
        flat = torch.cat([L.reshape(-1), A.reshape(-1), B.reshape(-1)])
        every = all_gather(flat, group)
        Ls, As, Bs = every.split(sizes, dim=1)
        Ls, As, Bs = Ls.view(P, *L.shape), As.view(P, *A.shape), Bs.view(P, *B.shape)
        E = As.exp().unsqueeze(-1) * Bs.exp().unsqueeze(-2)  # the diagonal transitions
        S, s_in = torch.zeros_like(L), None
        for r in order:
            if r == me:
                s_in = S
            S = E[r] * S + Ls[r]
        ctx.save_for_backward(E, s_in)
        ctx.group, ctx.order = group, order
        return s_in, S

    @staticmethod
    def backward(ctx, d_in, d_final):
        E, s_in = ctx.saved_tensors
        group, order = ctx.group, ctx.order
        me = dist.get_rank(group)
        every = all_gather(torch.stack([d_in, d_final]), group)
        G = every[:, 1].sum(0)  # the final state's cotangents from every rank add up
        for r in reversed(order[order.index(me) + 1:]):  # suffix combine down to me
            G = every[r, 0] + E[r] * G
        dE = G * s_in * E[me]
        return G, dE.sum(-1), dE.sum(-2), None, None


def _cumsum(x, reverse):
    """Inclusive sums along time (dim 1) in processing order."""
    return x.flip(1).cumsum(1).flip(1) if reverse else x.cumsum(1)


def _edge_sums(pc, lo, hi, reverse):
    """Each sequence's total over tokens [lo, hi) from the processing-order sums `pc`
    [B,T,H,D]: exact for a sequence that reaches the slice edge processing starts from
    (the one whose total matters: only it carries a state in)."""
    pad = pc.new_zeros(pc.shape[0], 1, *pc.shape[2:])
    if reverse:
        z = torch.cat([pc, pad], 1)
        return z.index_select(1, lo) - z.index_select(1, hi)
    z = torch.cat([pad, pc], 1)
    return z.index_select(1, hi) - z.index_select(1, lo)


def key_decay(g, gk, g_gamma, sid, lead, dtype):
    """a_t = g_t + gk_t + g_gamma, [B,T,H,1 or K] in `dtype` (None without key gates);
    `sid` [T]: the sequence of each token with cu_seqlens (for g_gamma [N, H])."""
    parts = []
    if g is not None:
        parts.append((g.unsqueeze(-1) if g.dim() == 3 else g).to(dtype))
    if gk is not None:
        parts.append(gk.to(dtype))
    if g_gamma is not None:
        gam = g_gamma.to(dtype)
        if gam.dim() == 1:
            gam = gam.view(1, 1, -1, 1)
        elif sid is None:
            gam = gam[:, None, :, None]
        else:
            gam = gam.index_select(0, sid.clamp(0, gam.shape[0] - 1))[None, :, :, None]
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
    P, me = group_size_rank(group)
    q, v, g, gk, gv, g_gamma, initial_state = (inputs[n] for n in (
        "q", "v", "g", "gk", "gv", "g_gamma", "initial_state"))
    B, T, H, K = q.shape
    V, dev = v.shape[-1], q.device
    order = list(range(P))[::-1] if reverse else list(range(P))
    if cu_seqlens is None:
        N = B
        own = torch.tensor(me == order[0], device=dev)
        lo = torch.zeros(1, dtype=torch.long, device=dev)
        hi = torch.full((1,), T, dtype=torch.long, device=dev)
        cu_loc = sid = None
    else:
        N = cu_seqlens.shape[0] - 1
        cu = cu_seqlens.long()
        # the owner of a sequence: the rank holding its first processed token
        first = (cu[1:] - 1) if reverse else cu[:-1]
        owner = torch.div(first, max(T, 1), rounding_mode="floor").clamp(0, P - 1)
        own = (owner == me)[:, None, None, None]
        cu_loc = (cu - me * T).clamp(0, T)
        lo, hi = cu_loc[:-1], cu_loc[1:]
        sid = torch.searchsorted(cu_loc, torch.arange(T, device=dev), right=True) - 1
        cu_loc = cu_loc.to(cu_seqlens.dtype)
    h0 = None if initial_state is None else torch.where(own, initial_state, 0)
    o_loc, L = local(dict(inputs, initial_state=h0), cu_loc)
    # the combine and the correction accumulate in wd: autocast must not downcast them
    with torch.autocast(q.device.type, enabled=False):
        wd = L.dtype  # float32, or float64 on the float64 torch path

        a = key_decay(g, gk, g_gamma, sid, (B, T, H), wd)
        b = None if gv is None else gv.to(wd)

        pa = None if a is None else _cumsum(a, reverse)
        pb = None if b is None else _cumsum(b, reverse)
        A = L.new_zeros(N, H, K) if a is None else \
            _edge_sums(pa, lo, hi, reverse).reshape(-1, H, pa.shape[-1]).expand(N, H, K)
        Bt = L.new_zeros(N, H, V) if b is None else \
            _edge_sums(pb, lo, hi, reverse).reshape(-1, H, V)
        s_in, final = _Exchange.apply(L, A, Bt, group, order)

        qa = q.to(wd) if pa is None else q.to(wd) * pa.exp()
        if sid is None:
            state = s_in
        else:  # only the sequence at the slice edge processing starts from carries a state in
            edge = sid[-1:] if reverse else sid[:1]
            if T == 0:
                edge = torch.zeros(1, dtype=torch.long, device=dev)
            state = s_in.index_select(0, edge.clamp(0, N - 1))
            qa = torch.where((sid == edge)[None, :, None, None], qa, 0)
        corr = torch.einsum("bthk,bhkv->bthv", qa, state) * scale
        if pb is not None:
            corr = corr * pb.exp()
        return (o_loc.to(wd) + corr).to(o_loc.dtype), final
