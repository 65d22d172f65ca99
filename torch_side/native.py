"""The chunked form of SPEC.md's recurrence in plain torch ops: the fast CPU path; its
entry points (recurrent_native, recurrent_native_backward) and the slab-by-slab drivers.

Tokens go into chunk slots (native_layout); everything inside a chunk is batched matmuls
over the slots, and only the K x V state recurrence runs sequentially, one step per chunk
position (native_chunk), with decay factors that never subtract long running sums
(native_decay). The slots are processed a slab of consecutive steps at a time, so memory
is the outputs plus one slab's workspace. Forward and backward are written by hand. The
backward first runs the state recurrence alone to get the state entering every chunk,
then walks the slabs in reverse order: each recomputes its in-chunk terms from those
states and passes the gradient of its entering state on to the slab before it. Tuning
knobs: NativeConfig (native_config), passed down from the entry points.
"""

from __future__ import annotations

import torch

from bridge.contract import INPUTS
from bridge.decay import key_decay

from .native_chunk import bmm, chunk_backward, chunk_forward, decayed_updates, state_recurrence
from .native_config import DEFAULT, NativeConfig
from .native_decay import block_decays, state_decay
from .native_layout import Slots, accumulation_dtype, call_layout

__all__ = ["NativeConfig", "recurrent_native", "recurrent_native_backward"]


def recurrent_native(plan, q, k, v, g=None, gk=None, gv=None, g_gamma=None, initial_state=None,
                     cu_seqlens=None, chunk_size=64, config: NativeConfig = DEFAULT):
    """SPEC.md's recurrence, chunked. Returns (o [B,T,H,V] in q's dtype, final_state
    [N,H,K,V] float32; float64 for float64 q).

    Batched layout as `plan` (bridge.contract.Plan) describes: q [B,T,H,K], k [B,T,Hk,K],
    v [B,T,Hk,V], g [B,T,H] or [B,T,H,K], gk [B,T,H,K], gv [B,T,H,V], g_gamma [H] or [N,H],
    initial_state [N,H,K,V]; with cu_seqlens [N+1], B == 1. chunk_size: a power of two.
    config: the tuning knobs (NativeConfig). Differentiable (once): autograd keeps only the
    inputs (see _NativeFunction).
    """
    if chunk_size < 1 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size: expected a power of two, got {chunk_size}")
    inputs = (q, k, v, g, gk, gv, g_gamma, initial_state)
    graph = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in inputs)
    if not graph and cu_seqlens is None and 0 < plan.T <= config.stepwise_tokens:
        return _stepwise(plan, accumulation_dtype(q), *inputs)
    layout = call_layout(plan, q, cu_seqlens, chunk_size)
    if graph:
        return _NativeFunction.apply(plan, layout, config, *inputs)
    return _streamed_forward(plan, layout, config, *inputs)


def recurrent_native_backward(plan, inputs, cu_seqlens, do, dfinal_state, chunk_size=64,
                              config: NativeConfig = DEFAULT):
    """{name: gradient} of the present inputs (`inputs`: the arrays of
    `bridge.contract.INPUTS` by name, absent ones None), each in its input's dtype and shape;
    `do` [B,T,H,V] and `dfinal_state` [N,H,K,V] may be None. Nothing of the forward is
    kept (an op's outputs need fixed shapes): the slab-by-slab backward recomputes it
    (_streamed_backward)."""
    layout = call_layout(plan, inputs["q"], cu_seqlens, chunk_size)
    got = _streamed_backward(plan, layout, config, tuple(inputs[n] for n in INPUTS), do,
                             dfinal_state)
    return {n: d for n, d in zip(INPUTS, got) if d is not None}


class _NativeFunction(torch.autograd.Function):
    """recurrent_native under autograd: the streamed forward, saving only the inputs; the
    backward recomputes it slab by slab (_streamed_backward)."""

    @staticmethod
    def forward(ctx, plan, layout, config, *inputs):
        ctx.plan, ctx.layout, ctx.config = plan, layout, config
        ctx.save_for_backward(*inputs)
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None
        return _streamed_forward(plan, layout, config, *inputs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dfinal_state):
        return (None,) * 3 + tuple(_streamed_backward(
            ctx.plan, ctx.layout, ctx.config, ctx.saved_tensors, do, dfinal_state))


def _streamed_forward(plan, layout, config, q, k, v, g, gk, gv, g_gamma, initial_state):
    """recurrent_native's forward, a slab of chunk steps at a time: besides o and the final
    states only one slab's inputs and temporaries (a few tens of config.slab_elements) are
    alive."""
    S = Slots(plan, layout, q, k, v, g, gk, gv, g_gamma)
    o = torch.empty(S.n_tokens, plan.H, plan.V, dtype=q.dtype, device=q.device)
    state, finals = S.by_rank(initial_state, plan.N, q), []
    for r0, r1, active, after in S.slabs(config):
        # only o, the final states and the carry: the slab's kept tensors go right away
        y, fin, state = chunk_forward(*S.inputs(r0, r1), state, active, config, after,
                                      keep=False)[:3]
        finals.append(fin)
        S.scatter(o, y, r0, r1)
        del y
    fin = torch.cat(finals[::-1], 1) if finals else state  # each slab ends the ranks after it
    return o.view(plan.B, plan.T, plan.H, plan.V), S.by_sequence(fin)


def _streamed_backward(plan, layout, config, inputs, do, dfinal_state):
    """Gradients of `inputs` (q, k, v, g, gk, gv, g_gamma, initial_state; None for absent
    ones, and in their place) from do [B,T,H,V] and dfinal_state [N,H,K,V] (either None),
    each in its input's dtype and shape. First the state recurrence alone gives the state
    entering each chunk; then, slab by slab in reverse, chunk_forward recomputes the slab
    from those states and chunk_backward turns the output's gradient and the gradient of
    the states leaving the slab into the slab's input gradients and that of its entering
    state. Memory: the gradients, the chunk-entering states ([H, K, V] a chunk: an input's
    size at K = V = C) and one slab's workspace."""
    q, k, v, g, gk, gv, g_gamma, h0 = inputs
    H, Hk, K, V, N = plan.H, plan.Hk, plan.K, plan.V, plan.N
    if do is None and dfinal_state is None:
        return [None if x is None else torch.zeros_like(x) for x in inputs]
    C, dtype = layout.chunk, layout.dtype
    S = Slots(plan, layout, q, k, v, g, gk, gv, g_gamma)
    slabs, entering, state = S.slabs(config, backward=True), [], S.by_rank(h0, N, q)
    for r0, r1, active, after in slabs:  # the states only: no in-chunk terms
        _, sk, sv, a, b = S.inputs(r0, r1, with_q=False)
        A, B, w, _ = block_decays(a, b, C, config, updates_only=True)
        ku, vu = decayed_updates(sk, sv, A, B, w)[2:]
        n = state.shape[1]  # the sequences entering the slab
        starts, _, state = state_recurrence(bmm(ku.mT, vu), state_decay(A, B), state, active,
                                            after)
        entering.append((starts, n))  # every chunk's: the recompute skips the recurrence
    del state

    L, dev = S.n_tokens, q.device
    dq = torch.empty(L, H, K, dtype=q.dtype, device=dev)
    dk, dv = (torch.empty(L, Hk, x.shape[-1], dtype=x.dtype, device=dev) for x in (k, v))
    Da = K if plan.g == "key" or gk is not None else 1  # the key gates' last dim
    ga = torch.empty(L, H, Da, dtype=dtype, device=dev) if g is not None or gk is not None \
        else None
    dgv = torch.empty(L, H, V, dtype=gv.dtype, device=dev) if gv is not None else None
    dgam = None if g_gamma is None else torch.zeros_like(S.gamma)
    do = None if do is None else do.reshape(L, H, V)
    dfin = S.by_rank(dfinal_state, N, q)
    dcarry = dfin if not slabs else dfin[:, :0]  # the gradient of the states leaving a slab
    for (r0, r1, active, after), (st, n) in zip(reversed(slabs), reversed(entering)):
        kept = chunk_forward(*S.inputs(r0, r1), None, active, config, after, out=False,
                             starts=st)[3]
        sdo = S.gather(do, r0, r1) if do is not None else torch.zeros(
            H, r1 - r0, C, V, dtype=dtype, device=dev)
        # the carry's gradient first, then the final states of the sequences ending here
        dleave = torch.cat([dcarry, dfin[:, after:n]], 1)
        sdq, sdk, sdv, sda, sdb, dcarry = chunk_backward(kept, active, sdo, dleave, config)
        del kept, sdo
        S.scatter(dq, sdq, r0, r1, plan.scale)
        if Hk != H:  # a kv head's gradient sums over the query heads that read it
            sdk, sdv = (x.unflatten(0, (Hk, -1)).sum(1) for x in (sdk, sdv))
        S.scatter(dk, sdk, r0, r1)
        S.scatter(dv, sdv, r0, r1)
        if ga is not None:
            S.scatter(ga, sda, r0, r1)
        if dgam is not None:  # summed over the tokens (not the padding) of each head / sequence
            keep = S.real_tokens(r0, r1)
            per = (sda if keep is None else sda * keep).sum((-1, -2))
            if dgam.shape[1] == 1:
                dgam += per.sum(1, keepdim=True)
            else:
                dgam.index_add_(1, layout.table.sequence[r0:r1], per)
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


def _stepwise(plan, dtype, q, k, v, g, gk, gv, g_gamma, initial_state):
    """Decoding (a few tokens a row, no cu_seqlens, no autograd): the recurrence itself,
    S <- e^{a_t} S e^{b_t} + k_t^T v_t and o_t = scale q_t S, one step a token on the
    [B, H, K, V] state; no chunks, no tables. At this size an op's dispatch costs as much
    as its work, so a step is few ops on views: the first decay makes the state's own
    copy (the input state is never written), the update adds k_t^T v_t in place with each
    kv head broadcast over its query heads."""
    B, T, H, Hk, K, V = plan.B, plan.T, plan.H, plan.Hk, plan.K, plan.V
    G = H // Hk  # query head h reads kv head h // G
    wide = lambda x: x if x.dtype == dtype else x.to(dtype)  # no op when already in dtype
    gam = None if g_gamma is None else wide(g_gamma).expand(B, H).unsqueeze(-1)
    S, own = (None if initial_state is None else wide(initial_state)), False
    o = torch.empty(T, B * H, 1, V, dtype=q.dtype, device=q.device)  # o[t]: a bmm's shape
    for t in (reversed(range(T)) if plan.reverse else range(T)):
        a = key_decay(  # [B, H, K or 1]
            None if g is None else wide(g.select(1, t).unsqueeze(-1) if plan.g == "head"
                                        else g.select(1, t)),
            None if gk is None else wide(gk.select(1, t)), gam)
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
        if o.dtype == dtype:  # o_t = scale q_t S written in place
            o.select(0, t).baddbmm_(qt, St, beta=0, alpha=plan.scale)
        else:
            o.select(0, t).copy_(torch.bmm(qt, St).mul_(plan.scale))
    o = o.view(T, B, H, V)
    return (o.view(B, T, H, V) if T == 1 else o.transpose(0, 1).contiguous()), S
