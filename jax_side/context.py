"""Context parallelism: the time axis split over a mesh axis (`context_axis=`), the
algorithm of SPEC.md's "Context parallelism" in its names (bridge/context.py lists them
and holds the framework-neutral steps); torch_side/context.py is the PyTorch twin.

Called inside `jax.shard_map` with q/k/v/gates sharded over the time (or packed token)
axis: device p of P holds tokens [p*T, (p+1)*T). The combine accumulates in float32
(float64 with float64 inputs on the XLA path: the local pass's final-state dtype).
Gradients: JAX autodiff of this composition (the local pass's own VJP, the transpose of
the all_gather and of the prefix combine: a suffix combine of the state gradients);
every collective is state-sized, nothing of size T.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from bridge import context as combine
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
    return combine.local_offsets(cu, T_local, p).astype(cu.dtype)


def _key_decay(plan, g, gk, g_gamma, seq, dtype):
    """a_t = g_t + gk_t + g_gamma, [B,T,H,K or 1] in `dtype` (None without key gates);
    `seq` [T]: each token's sequence with cu_seqlens (for g_gamma [N, H])."""
    a = None
    if plan.g != "none":
        a = g.astype(dtype) if plan.g == "key" else g.astype(dtype)[..., None]
    if plan.gk:
        a = gk.astype(dtype) if a is None else a + gk.astype(dtype)
    if plan.g_gamma != "none":
        gam = g_gamma.astype(dtype)
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
    """Inclusive sums along time (axis 1) from the slice's entry edge."""
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
    reverse = plan.reverse
    order = combine.visiting_order(P, reverse)

    seq = None  # each local token's sequence [T]
    if plan.varlen:
        t = jnp.arange(T, dtype=cu_seqlens.dtype)
        seq = jnp.searchsorted(cu_seqlens[1:], t, side="right").astype(jnp.int32)
        seq = jnp.minimum(seq, N - 1)

    # 1. the local pass; initial_state[n] enters on the device of n's first processed token
    h0 = None
    if initial_state is not None:
        if plan.varlen:
            cu = jnp.asarray(cu_global).astype(jnp.int32)
            starts_here = combine.first_device(cu, T, P, reverse) == p
        else:
            starts_here = jnp.broadcast_to(p == order[0], (N,))
        h0 = jnp.where(starts_here[:, None, None, None], initial_state,
                       jnp.zeros((), initial_state.dtype))
    local_plan = dataclasses.replace(plan, initial_state=h0 is not None)
    o_loc, F = local(local_plan, dict(inputs, initial_state=h0), cu_seqlens)
    acc = F.dtype

    # 2. each sequence's summed log decays over the slice
    a = _key_decay(plan, g, gk, g_gamma, seq, acc)
    b = gv.astype(acc) if plan.gv else None
    seq_sum = ((lambda x: x.sum(1)) if not plan.varlen
               else (lambda x: jax.ops.segment_sum(x[0], seq, N)))  # [N,H,D]
    A = jnp.zeros((N, H, K), acc) if a is None else jnp.broadcast_to(seq_sum(a), (N, H, K))
    B = jnp.zeros((N, H, V), acc) if b is None else seq_sum(b)

    # 3. one all_gather of everything state-sized, invariant over the axis after it
    packed = jnp.concatenate([F.reshape(N, H, K * V), A, B], -1)
    gathered = lax.all_gather(packed, axis, to="invarying")  # [P, N, H, K*V+K+V]
    Fs = gathered[..., :K * V].reshape(P, N, H, K, V)
    As, Bs = gathered[..., K * V:K * V + K], gathered[..., K * V + K:]

    # 4. the prefix combine in visiting order
    S_in, final_state = combine.prefix_combine(
        Fs, lambda j, S: jnp.exp(As[j])[..., None] * S * jnp.exp(Bs[j])[..., None, :],
        order, jnp.zeros((N, H, K, V), acc))
    S_in = jnp.stack(S_in)[p]  # [N,H,K,V], varying over the axis (p is traced)

    # 5. the correction of the sequence at the entry edge, n0 (the only one with a state
    # coming in)
    if T == 0:
        return o_loc, final_state
    if plan.varlen:
        n0 = seq[T - 1] if reverse else seq[0]
        S_n0 = S_in[n0][None]  # [1,H,K,V]
        of_n0 = (seq == n0)[None, :, None, None]
    else:
        S_n0, of_n0 = S_in, None
    qa = q.astype(acc) * plan.scale
    if a is not None:
        qa = qa * jnp.exp(_edge_cumsum(a, reverse))
    corr = jnp.einsum("bthk,bhkv->bthv", qa, S_n0)
    if b is not None:
        corr = corr * jnp.exp(_edge_cumsum(b, reverse))
    if of_n0 is not None:
        corr = jnp.where(of_n0, corr, 0.0)
    return (o_loc.astype(acc) + corr).astype(o_loc.dtype), final_state
