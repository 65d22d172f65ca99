"""Float64 NumPy oracle of SPEC.md's recurrence: the independent reference.

Plain loops over sequences, heads and time steps, float64 throughout, nothing
imported from the project. Inputs may be any float dtype (bfloat16 via
ml_dtypes included); everything is returned as float64.

For sequence n, query head h (kv head h // (H // Hk)) and each step t:

    a_t = g_t + gk_t + g_gamma[h]                     (over K; absent terms 0)
    b_t = gv_t                                        (over V)
    S_t = diag(exp a_t) S_{t-1} diag(exp b_t) + k_t^T v_t,   S_0 = initial_state[n, h]
    o_t = scale * q_t S_t

Layouts: batched [B,T,H,*], or with cu_seqlens packed [total,H,*] (also
accepted as [1,total,H,*]); outputs and gradients keep the form of the inputs.
"""

import numpy as np


def _f64(x):
    return None if x is None else np.asarray(x, dtype=np.float64)


class _Problem:
    """The inputs as float64 [B,T,H,*] arrays (g widened to [B,T,H,K]), the
    sequences as (n, b, steps in processing order), and the scale."""

    def __init__(self, q, k, v, g, g_gamma, gk, gv, softmax_scale, initial_state,
                 reverse, cu_seqlens):
        q, k, v, g, gk, gv = (_f64(x) for x in (q, k, v, g, gk, gv))
        self.g_per_head = g is not None and g.ndim == q.ndim - 1
        self.packed = cu_seqlens is not None and q.ndim == 3
        if self.packed:  # [total,H,*] -> [1,total,H,*]
            q, k, v, g, gk, gv = (None if x is None else x[None] for x in (q, k, v, g, gk, gv))
        if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
            raise ValueError(f"q, k, v must be [B,T,H,*]; got {q.shape}, {k.shape}, {v.shape}")
        B, T, H, K = q.shape
        Hk, V = k.shape[2], v.shape[3]
        if k.shape != (B, T, Hk, K) or v.shape[:3] != (B, T, Hk) or H % Hk != 0:
            raise ValueError(f"k {k.shape} / v {v.shape} do not fit q {q.shape}")
        if self.g_per_head:  # one decay per head and step, the same for every key dim
            g = np.repeat(g[..., None], K, axis=-1)
        if cu_seqlens is None:
            bounds = [(b, 0, T) for b in range(B)]
        else:
            cu = [int(c) for c in np.asarray(cu_seqlens).reshape(-1)]
            if B != 1 or cu[0] != 0 or cu[-1] != T or any(x > y for x, y in zip(cu, cu[1:])):
                raise ValueError(f"cu_seqlens {cu} does not fit B={B}, T={T}")
            bounds = [(0, cu[i], cu[i + 1]) for i in range(len(cu) - 1)]
        self.N = len(bounds)
        self.seqs = [(n, b, list(range(e - 1, s - 1, -1)) if reverse else list(range(s, e)))
                     for n, (b, s, e) in enumerate(bounds)]
        self.h0 = np.zeros((self.N, H, K, V)) if initial_state is None else _f64(initial_state)
        if self.h0.shape != (self.N, H, K, V):
            raise ValueError(f"initial_state must be {(self.N, H, K, V)}, got {self.h0.shape}")
        g_gamma = _f64(g_gamma)
        if g_gamma is not None and g_gamma.shape not in ((H,), (self.N, H)):
            raise ValueError(f"g_gamma must be [H] or [N,H], got {g_gamma.shape}")
        self.q, self.k, self.v, self.g, self.gk, self.gv, self.g_gamma = q, k, v, g, gk, gv, g_gamma
        self.B, self.T, self.H, self.Hk, self.K, self.V = B, T, H, Hk, K, V
        self.group = H // Hk
        self.scale = K ** -0.5 if softmax_scale is None else float(softmax_scale)

    def log_decays(self, n, b, t, h):
        """(a_t [K], b_t [V]) for sequence n, batch row b, step t, query head h."""
        a = np.zeros(self.K)
        if self.g is not None:
            a = a + self.g[b, t, h]
        if self.gk is not None:
            a = a + self.gk[b, t, h]
        if self.g_gamma is not None:
            a = a + (self.g_gamma[h] if self.g_gamma.ndim == 1 else self.g_gamma[n, h])
        bv = np.zeros(self.V) if self.gv is None else self.gv[b, t, h]
        return a, bv

    def unbatch(self, x):
        return x[0] if self.packed else x


def recurrent(q, k, v, g=None, g_gamma=None, gk=None, gv=None, softmax_scale=None,
              initial_state=None, reverse=False, cu_seqlens=None):
    """Returns (o, final_state): o [B,T,H,V] (packed: [total,H,V]), final_state [N,H,K,V]."""
    p = _Problem(q, k, v, g, g_gamma, gk, gv, softmax_scale, initial_state, reverse, cu_seqlens)
    o = np.zeros((p.B, p.T, p.H, p.V))
    final_state = np.zeros((p.N, p.H, p.K, p.V))
    for n, b, steps in p.seqs:
        for h in range(p.H):
            j = h // p.group
            S = p.h0[n, h].copy()
            for t in steps:
                a, bv = p.log_decays(n, b, t, h)
                S = (np.exp(a)[:, None] * S * np.exp(bv)[None, :]
                     + np.outer(p.k[b, t, j], p.v[b, t, j]))
                o[b, t, h] = p.scale * (p.q[b, t, h] @ S)
            final_state[n, h] = S
    return p.unbatch(o), final_state


def recurrent_grads(q, k, v, g=None, g_gamma=None, gk=None, gv=None, softmax_scale=None,
                    initial_state=None, reverse=False, cu_seqlens=None, *, do,
                    dfinal_state=None):
    """Gradients of L = sum(o * do) + sum(final_state * dfinal_state) w.r.t. each GIVEN
    input among q, k, v, g, gk, gv, g_gamma, initial_state, in that input's shape.

    Adjoint recurrence, walking the steps of each sequence backwards with dS = dL/dS_t:
        dS  += scale q_t^T do_t              dq_t = scale S_t do_t
        dk_t = dS v_t                         dv_t = k_t dS    (summed over a kv group)
        P    = dS * (diag(e^a_t) S_{t-1} diag(e^b_t))
        da_t = P summed over V,  db_t = P summed over K
        dS   = diag(e^a_t) dS diag(e^b_t)     (dL/dS_{t-1}; after the first step: d initial_state)
    da_t is the gradient of g (summed over K for [B,T,H] g), of gk, and, summed over
    t and K, of g_gamma; db_t is that of gv."""
    p = _Problem(q, k, v, g, g_gamma, gk, gv, softmax_scale, initial_state, reverse, cu_seqlens)
    do = _f64(do)
    do = do[None] if p.packed else do
    dq, dk, dv = np.zeros_like(p.q), np.zeros_like(p.k), np.zeros_like(p.v)
    da = np.zeros((p.B, p.T, p.H, p.K))
    db = np.zeros((p.B, p.T, p.H, p.V))
    dgamma = np.zeros((p.N, p.H))
    dh0 = np.zeros((p.N, p.H, p.K, p.V))
    for n, b, steps in p.seqs:
        for h in range(p.H):
            j = h // p.group
            states = [p.h0[n, h].copy()]  # states[i] = state after i steps
            for t in steps:
                a, bv = p.log_decays(n, b, t, h)
                S = np.exp(a)[:, None] * states[-1] * np.exp(bv)[None, :]
                states.append(S + np.outer(p.k[b, t, j], p.v[b, t, j]))
            dS = np.zeros((p.K, p.V)) if dfinal_state is None else _f64(dfinal_state)[n, h].copy()
            for i in reversed(range(len(steps))):
                t = steps[i]
                S_prev, S_t = states[i], states[i + 1]
                a, bv = p.log_decays(n, b, t, h)
                ea, eb = np.exp(a)[:, None], np.exp(bv)[None, :]
                dS = dS + p.scale * np.outer(p.q[b, t, h], do[b, t, h])
                dq[b, t, h] = p.scale * (S_t @ do[b, t, h])
                dk[b, t, j] += dS @ p.v[b, t, j]
                dv[b, t, j] += p.k[b, t, j] @ dS
                P = dS * (ea * S_prev * eb)
                da[b, t, h] = P.sum(axis=1)
                db[b, t, h] = P.sum(axis=0)
                dgamma[n, h] += P.sum()
                dS = ea * dS * eb
            dh0[n, h] = dS

    grads = {"q": p.unbatch(dq), "k": p.unbatch(dk), "v": p.unbatch(dv)}
    if g is not None:
        grads["g"] = p.unbatch(da.sum(axis=-1) if p.g_per_head else da)
    if gk is not None:
        grads["gk"] = p.unbatch(da)
    if gv is not None:
        grads["gv"] = p.unbatch(db)
    if g_gamma is not None:
        grads["g_gamma"] = dgamma.sum(axis=0) if p.g_gamma.ndim == 1 else dgamma
    if initial_state is not None:
        grads["initial_state"] = dh0
    return grads


def recurrent_gla(q, k, v, g=None, g_gamma=None, softmax_scale=None, initial_state=None,
                  reverse=False, cu_seqlens=None):
    """GLA: g is the key-dim log decay [B,T,H,K] ([B,T,H] also accepted). (o, final_state)."""
    return recurrent(q, k, v, g=g, g_gamma=g_gamma, softmax_scale=softmax_scale,
                     initial_state=initial_state, reverse=reverse, cu_seqlens=cu_seqlens)


def lightning_attn(q, k, v, layer_idx, num_layers, softmax_scale=None, initial_state=None,
                   reverse=False, cu_seqlens=None):
    """Lightning attention: recurrent with g_gamma [H] =
    -(8 / H * (1 - layer_idx / num_layers)) * arange(H), computed in float32. (o, final_state)."""
    H = np.shape(q)[-2]
    coef = np.float32(-(8 / H * (1 - layer_idx / num_layers)))
    g_gamma = coef * np.arange(H, dtype=np.float32)  # float32 product, as torch does
    return recurrent(q, k, v, g_gamma=g_gamma, softmax_scale=softmax_scale,
                     initial_state=initial_state, reverse=reverse, cu_seqlens=cu_seqlens)
