"""The float64 NumPy oracle: SPEC.md's recurrence written as plainly as the mathematics.

Loops over sequences, heads and time; no chunking, no cleverness; every backend
is checked against it. It imports nothing from the project, so it stays an
independent reference. Inputs: NumPy arrays of any float dtype (bf16 through
ml_dtypes included), computed and returned in float64; batched [B,T,H,*] or,
with cu_seqlens, packed [total,H,*] (outputs and gradients keep that form).
"""

import numpy as np


def _f64(x):
    return None if x is None else np.asarray(x, dtype=np.float64)


def _setup(q, k, v, g, g_gamma, gk, gv, initial_state, cu_seqlens, softmax_scale):
    q, k, v, g, g_gamma, gk, gv, h0 = map(_f64, (q, k, v, g, g_gamma, gk, gv, initial_state))
    packed = cu_seqlens is not None and q.ndim == 3
    g_per_head = g is not None and g.ndim == q.ndim - 1
    if packed:  # view packed input as a batch of one
        q, k, v, g, gk, gv = (None if x is None else x[None] for x in (q, k, v, g, gk, gv))
    B, T, H, K = q.shape
    if g_per_head:  # [B,T,H]: one decay per head and step, the same for every key dim
        g = np.repeat(g[..., None], K, axis=-1)
    if cu_seqlens is None:
        seqs = [(b, 0, T) for b in range(B)]
    else:
        cu = [int(c) for c in np.asarray(cu_seqlens)]
        seqs = [(0, cu[i], cu[i + 1]) for i in range(len(cu) - 1)]
    scale = K ** -0.5 if softmax_scale is None else float(softmax_scale)
    return q, k, v, g, g_gamma, gk, gv, h0, seqs, packed, g_per_head, scale


def _log_decays(g, gk, gv, g_gamma, b, t, h, n, K, V):
    """a_t over K (g + gk + g_gamma) and b_t over V (gv); absent terms are 0."""
    a = np.zeros(K)
    if g is not None:
        a += g[b, t, h]
    if gk is not None:
        a += gk[b, t, h]
    if g_gamma is not None:
        a += g_gamma[h] if g_gamma.ndim == 1 else g_gamma[n, h]
    return a, (np.zeros(V) if gv is None else gv[b, t, h])


def _steps(start, end, reverse):
    return range(end - 1, start - 1, -1) if reverse else range(start, end)


def recurrent(q, k, v, g=None, g_gamma=None, gk=None, gv=None, softmax_scale=None,
              initial_state=None, reverse=False, cu_seqlens=None):
    """(o [B,T,H,V] or packed [total,H,V], final_state [N,H,K,V]), float64.

    S_t = diag(exp a_t) S_{t-1} diag(exp b_t) + k_t^T v_t,  o_t = scale q_t S_t."""
    q, k, v, g, g_gamma, gk, gv, h0, seqs, packed, _, scale = _setup(
        q, k, v, g, g_gamma, gk, gv, initial_state, cu_seqlens, softmax_scale)
    B, T, H, K = q.shape
    V, group = v.shape[-1], H // k.shape[2]
    o = np.zeros((B, T, H, V))
    final = np.zeros((len(seqs), H, K, V))
    for n, (b, start, end) in enumerate(seqs):
        for h in range(H):
            S = np.zeros((K, V)) if h0 is None else h0[n, h].copy()
            for t in _steps(start, end, reverse):
                a, bv = _log_decays(g, gk, gv, g_gamma, b, t, h, n, K, V)
                S = np.exp(a)[:, None] * S * np.exp(bv)[None, :]
                S = S + np.outer(k[b, t, h // group], v[b, t, h // group])
                o[b, t, h] = scale * q[b, t, h] @ S
            final[n, h] = S
    return (o[0] if packed else o), final


def recurrent_grads(q, k, v, g=None, g_gamma=None, gk=None, gv=None, softmax_scale=None,
                    initial_state=None, reverse=False, cu_seqlens=None, *, do,
                    dfinal_state=None):
    """Gradients of sum(o * do) + sum(final_state * dfinal_state) for every given
    differentiable input, each in its input's shape, by the adjoint recurrence:
    the states S_t are kept from a forward pass, then dS runs backwards in time:
        dS_t += scale q_t^T do_t;  dq_t = scale S_t do_t;  dk_t = dS_t v_t;  dv_t = k_t dS_t
        da_t = sum_j dS_t * (diag(e^a_t) S_{t-1} diag(e^b_t));  db_t likewise over i
        dS_{t-1} = diag(e^a_t) dS_t diag(e^b_t),  and d(initial_state) = dS_0."""
    given = dict(g=g, gk=gk, gv=gv, g_gamma=g_gamma, initial_state=initial_state)
    q, k, v, g, g_gamma, gk, gv, h0, seqs, packed, g_per_head, scale = _setup(
        q, k, v, g, g_gamma, gk, gv, initial_state, cu_seqlens, softmax_scale)
    do = _f64(do)[None] if packed else _f64(do)
    dht = None if dfinal_state is None else _f64(dfinal_state)
    B, T, H, K = q.shape
    V, group = v.shape[-1], H // k.shape[2]
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    da, db = np.zeros((B, T, H, K)), np.zeros((B, T, H, V))
    dgamma, dh0 = np.zeros((len(seqs), H)), np.zeros((len(seqs), H, K, V))
    for n, (b, start, end) in enumerate(seqs):
        for h in range(H):
            kh = h // group
            S = np.zeros((K, V)) if h0 is None else h0[n, h].copy()
            decayed_prev = {}  # t -> diag(e^a_t) S_{t-1} diag(e^b_t), and the decays
            for t in _steps(start, end, reverse):
                a, bv = _log_decays(g, gk, gv, g_gamma, b, t, h, n, K, V)
                decayed = np.exp(a)[:, None] * S * np.exp(bv)[None, :]
                decayed_prev[t] = (decayed, a, bv)
                S = decayed + np.outer(k[b, t, kh], v[b, t, kh])
                dq[b, t, h] = scale * S @ do[b, t, h]
            dS = np.zeros((K, V)) if dht is None else dht[n, h].copy()
            for t in reversed(_steps(start, end, reverse)):
                decayed, a, bv = decayed_prev[t]
                dS = dS + scale * np.outer(q[b, t, h], do[b, t, h])
                dk[b, t, kh] += dS @ v[b, t, kh]
                dv[b, t, kh] += k[b, t, kh] @ dS
                da[b, t, h] = (dS * decayed).sum(axis=1)
                db[b, t, h] = (dS * decayed).sum(axis=0)
                dgamma[n, h] += (dS * decayed).sum()
                dS = np.exp(a)[:, None] * dS * np.exp(bv)[None, :]
            dh0[n, h] = dS

    unbatch = (lambda x: x[0]) if packed else (lambda x: x)
    out = dict(q=unbatch(dq), k=unbatch(dk), v=unbatch(dv))
    if given["g"] is not None:
        out["g"] = unbatch(da.sum(axis=-1) if g_per_head else da)
    if given["gk"] is not None:
        out["gk"] = unbatch(da)
    if given["gv"] is not None:
        out["gv"] = unbatch(db)
    if given["g_gamma"] is not None:
        out["g_gamma"] = dgamma.sum(axis=0) if np.ndim(given["g_gamma"]) == 1 else dgamma
    if given["initial_state"] is not None:
        out["initial_state"] = dh0
    return out


def recurrent_gla(q, k, v, g=None, g_gamma=None, softmax_scale=None, initial_state=None,
                  reverse=False, cu_seqlens=None):
    """GLA: `g` is the key-dim log decay ([B,T,H,K]; [B,T,H] also accepted)."""
    return recurrent(q, k, v, g=g, g_gamma=g_gamma, softmax_scale=softmax_scale,
                     initial_state=initial_state, reverse=reverse, cu_seqlens=cu_seqlens)


def lightning_attn(q, k, v, layer_idx, num_layers, softmax_scale=None, initial_state=None,
                   reverse=False, cu_seqlens=None):
    """Lightning attention: g_gamma = -(8/H * (1 - layer_idx/num_layers)) * arange(H), float32."""
    H = np.shape(q)[-2]
    g_gamma = (-(8.0 / H * (1.0 - layer_idx / num_layers)) * np.arange(H)).astype(np.float32)
    return recurrent(q, k, v, g_gamma=g_gamma, softmax_scale=softmax_scale,
                     initial_state=initial_state, reverse=reverse, cu_seqlens=cu_seqlens)
