"""Context parallelism: the time axis split over a mesh axis (`context_axis=`).

Called inside `jax.shard_map` with q/k/v/gates sharded over the time (or packed
token) axis: device p of P holds tokens [p*Tl, (p+1)*Tl), in processing order
p = 0..P-1 (P-1..0 with `reverse`). The combine (bridge/SPEC.md, "Context
parallelism"; the PyTorch twin computes the same):

1. Local pass over the slice with any platform, from a zero state, except that
   `initial_state[n]` enters on the device where sequence n's processing starts.
   It gives o_loc and the slice's final state F_p [N,H,K,V].
2. The slice's total log decays per sequence, A_p [N,H,K] (key side) and
   B_p [N,H,V] (value side), fp32 sums of the local gates.
3. ONE all_gather of (F_p, A_p, B_p), packed in one [N,H,K*V+K+V] buffer.
4. Prefix combine in fp32, in processing order, from zero:
       S_in_0 = 0,  S_in_{j+1} = exp(A_j)[:, None] * S_in_j * exp(B_j)[None, :] + F_j
   (the decays are diagonal, so a transition is an elementwise scale); the final
   state is S_in_P, computed identically on every device (invariant over the axis).
5. Only the sequence in progress at the slice's entry edge (its first token, or
   last with `reverse`) has a nonzero incoming state S = S_in_p[n0]: its tokens get
       o_t += (scale * q_t * exp(ca_t)) @ S * exp(cb_t)
   with ca_t, cb_t the inclusive cumulative log decays from the entry edge to t.

Gradients: JAX autodiff of this composition (the local pass's own VJP, the
transpose of the all_gather and of the prefix combine: a suffix combine of the
state gradients); every collective is state-sized, nothing of size T.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from bridge import contract


def axis_position(axis):
    """(P, p) of the mesh axis `axis`: its size and this device's index; a ValueError
    naming `context_axis` outside a shard_map that binds it."""
    if not isinstance(axis, str):
        raise TypeError(f"context_axis: expected a mesh axis name (str), got "
                        f"{type(axis).__name__}")
    try:
        return lax.axis_size(axis), lax.axis_index(axis)
    except NameError as e:
        raise ValueError(f"context_axis: {axis!r} is not an axis of the enclosing "
                         f"jax.shard_map (call it inside shard_map, with the time axis "
                         f"sharded over {axis!r})") from e


def local_offsets(cu_seqlens, T_local, axis):
    """The global packed offsets cu_seqlens [N+1] as offsets into this device's
    slice of T_local tokens (sequences outside it become empty)."""
    P, p = axis_position(axis)
    cu = jnp.asarray(cu_seqlens)
    known = contract.known_values(cu)
    if known is not None:  # the contract's value checks, against the global count
        tokens = np.broadcast_to(np.float32(0), (P * T_local, 1, 1))  # no memory
        contract.check(tokens, tokens, tokens, cu_seqlens=np.asarray(known))
    return jnp.clip(cu - p * T_local, 0, T_local).astype(cu.dtype)


def _key_decay(plan, g, gk, g_gamma, seq, ct):
    """Per-token key-side log decay a [B,T,H,K or 1] in ct (None without gates)."""
    a = None
    if plan.g != "none":
        a = g.astype(ct) if plan.g == "key" else g.astype(ct)[..., None]
    if plan.gk:
        a = gk.astype(ct) if a is None else a + gk.astype(ct)
    if plan.g_gamma != "none":
        gam = g_gamma.astype(ct)
        if plan.g_gamma == "head":
            gam = gam[None, None]                       # [1,1,H]
        elif plan.varlen:
            gam = gam[seq][None]                        # [1,T,H]: each token's sequence
        else:
            gam = gam[:, None]                          # [B,1,H]
        gam = jnp.broadcast_to(gam, (plan.B, plan.T, plan.H))[..., None]
        a = gam if a is None else a + gam
    return a


def _edge_cumsum(x, reverse):
    """Inclusive cumulative sum over time from the slice's entry edge."""
    return jnp.flip(jnp.cumsum(jnp.flip(x, 1), 1), 1) if reverse else jnp.cumsum(x, 1)


def context_parallel(plan, local, axis, inputs, cu_seqlens, cu_global):
    """SPEC.md's recurrence over a time axis sharded on mesh axis `axis`.

    plan: the contract's Plan of this device's slice (local T; with cu_seqlens the
    local offsets from `local_offsets`). local(plan, inputs, cu_seqlens) -> (o,
    final_state): one platform's call. `inputs`: the arrays of `bridge.grads.INPUTS` by
    name (absent ones None), batched layout; cu_seqlens are the local offsets
    (`local_offsets`) of the global ones, cu_global. Returns o [B,T,H,V] (this slice)
    and final_state [N,H,K,V], the same on every device of `axis`.
    """
    P, p = axis_position(axis)
    q, g, gk, gv, g_gamma, initial_state = (inputs[n] for n in (
        "q", "g", "gk", "gv", "g_gamma", "initial_state"))
    N, H, K, V, T = plan.N, plan.H, plan.K, plan.V, plan.T
    rev = plan.reverse

    seq = None  # each local token's sequence [T]
    if plan.varlen:
        t = jnp.arange(T, dtype=cu_seqlens.dtype)
        seq = jnp.searchsorted(cu_seqlens[1:], t, side="right").astype(jnp.int32)
        seq = jnp.minimum(seq, N - 1)

    # 1. local pass; initial_state[n] enters on the device that holds sequence n's
    # first processed token (an empty sequence: any one device)
    h0 = None
    if initial_state is not None:
        if plan.varlen:
            cu = jnp.asarray(cu_global).astype(jnp.int32)
            entry = (cu[1:] - 1) if rev else cu[:-1]
            starts = jnp.clip(entry // max(T, 1), 0, P - 1) == p
        else:
            starts = jnp.broadcast_to(p == (P - 1 if rev else 0), (N,))
        h0 = jnp.where(starts[:, None, None, None], initial_state,
                       jnp.zeros((), initial_state.dtype))
    local_plan = dataclasses.replace(plan, initial_state=h0 is not None)
    o, fin = local(local_plan, dict(inputs, initial_state=h0), cu_seqlens)
    ct = fin.dtype

    # 2. the slice's total log decays per sequence
    a = _key_decay(plan, g, gk, g_gamma, seq, ct)
    b = gv.astype(ct) if plan.gv else None
    seq_sum = ((lambda x: x.sum(1)) if not plan.varlen
               else (lambda x: jax.ops.segment_sum(x[0], seq, N)))  # [N,H,D]
    A = jnp.zeros((N, H, K), ct) if a is None else jnp.broadcast_to(seq_sum(a), (N, H, K))
    B = jnp.zeros((N, H, V), ct) if b is None else seq_sum(b)

    # 3. one all_gather of everything state-sized, invariant over the axis after it
    packed = jnp.concatenate([fin.reshape(N, H, K * V), A, B], -1)
    allp = lax.all_gather(packed, axis, to="invarying")  # [P, N, H, K*V+K+V]
    Fs = allp[..., :K * V].reshape(P, N, H, K, V)
    As, Bs = allp[..., K * V:K * V + K], allp[..., K * V + K:]

    # 4. prefix combine in processing order
    S = jnp.zeros((N, H, K, V), ct)
    entering = [None] * P
    for j in (range(P - 1, -1, -1) if rev else range(P)):
        entering[j] = S
        S = jnp.exp(As[j])[..., None] * S * jnp.exp(Bs[j])[..., None, :] + Fs[j]
    final = S
    S_in = jnp.stack(entering)[p]  # [N,H,K,V], varying over the axis

    # 5. the correction of the sequence in progress at the entry edge
    if T == 0:
        return o, final
    if plan.varlen:
        n0 = seq[T - 1] if rev else seq[0]
        S0 = S_in[n0][None]  # [1,H,K,V]
        mine = (seq == n0)[None, :, None, None]
    else:
        S0, mine = S_in, None
    qa = q.astype(ct) * plan.scale
    if a is not None:
        qa = qa * jnp.exp(_edge_cumsum(a, rev))
    corr = jnp.einsum("bthk,bhkv->bthv", qa, S0)
    if b is not None:
        corr = corr * jnp.exp(_edge_cumsum(b, rev))
    if mine is not None:
        corr = jnp.where(mine, corr, 0.0)
    o = (o.astype(ct) + corr).astype(o.dtype)
    return o, final
