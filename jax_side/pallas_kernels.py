"""Pallas kernel bodies for one chunk of gated linear attention (TPU / interpret).

Every body sees one chunk of C tokens of one (row, head, value block):
q, k [C, Kp], v, do [C, BV], a [C, Kp] key-side log gates, b [C, BV] value-side
log gates (optional), all float32. Running log-gate sums inside the chunk are a
matmul with a lower-triangular ones matrix (Mosaic has no cumsum). C is 16, so
each difference of running sums spans at most 16 gates (scan-level precision
with strong gates), and every exponent taken is a sum of gates over a span
(<= 0 for gates <= 0): pairs go through a masked [C, C, D] difference, never
through e^{+A}.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

HI = lax.Precision.HIGHEST
F32 = jnp.float32
NEG = -1e30


def mm(x, y):
    """x @ y."""
    return jnp.dot(x, y, precision=HI, preferred_element_type=F32)


def mm_tn(x, y):
    """x^T @ y (contract the leading dims)."""
    return lax.dot_general(x, y, (((0,), (0,)), ((), ())), precision=HI,
                           preferred_element_type=F32)


def mm_nt(x, y):
    """x @ y^T (contract the trailing dims)."""
    return lax.dot_general(x, y, (((1,), (1,)), ((), ())), precision=HI,
                           preferred_element_type=F32)


def _iota2(n, m):
    return lax.broadcasted_iota(jnp.int32, (n, m), 0), lax.broadcasted_iota(jnp.int32, (n, m), 1)


def tri(C, strict=False, upper=False):
    """[C, C] ones below (or above) the diagonal, diagonal included unless strict."""
    r, c = _iota2(C, C)
    m = (c < r if strict else c <= r) if not upper else (c > r if strict else c >= r)
    return m.astype(F32)


def column(row):
    """[1, D] -> [D, 1] without a transpose: diag(row) summed over lanes."""
    D = row.shape[-1]
    r, c = _iota2(D, D)
    return jnp.sum(jnp.where(r == c, jnp.broadcast_to(row, (D, D)), 0.0), axis=1, keepdims=True)


def pair_decay(A, strict=False):
    """e^{A_t - A_s} for s <= t (s < t if strict), else 0: [C(t), C(s), D]."""
    C, D = A.shape
    t = lax.broadcasted_iota(jnp.int32, (C, C, D), 0)
    s = lax.broadcasted_iota(jnp.int32, (C, C, D), 1)
    m = s < t if strict else s <= t
    d = A[:, None, :] - A[None, :, :]
    return jnp.where(m, jnp.exp(jnp.where(m, d, 0.0)), 0.0)


class Chunk:
    """The per-chunk quantities shared by the kernels (see the module docstring)."""

    def __init__(self, q, k, a, b):
        C = q.shape[0]
        L = tri(C)
        self.C, self.q, self.k = C, q, k
        self.A = mm(L, a)
        self.At = self.A[C - 1:, :]  # [1, Kp]: the whole chunk's key-side decay
        self.eA = jnp.exp(self.A)
        self.eAr = jnp.exp(self.At - self.A)  # from after s to the chunk's end
        self.has_b = b is not None
        if self.has_b:
            self.B = mm(L, b)
            self.Bt = self.B[C - 1:, :]
            self.eB, self.eBr = jnp.exp(self.B), jnp.exp(self.Bt - self.B)

    def decay_state(self, S):
        """diag(e^At) S diag(e^Bt) for S [Kp, BV]."""
        S = column(jnp.exp(self.At)) * S
        return S * jnp.exp(self.Bt) if self.has_b else S

    def weights(self):
        """E [C,C,Kp] = e^{A_t-A_s} (s <= t), P [C,C] = sum_d q_td k_sd E_tsd, F [C,C,BV] or None."""
        E = pair_decay(self.A)
        P = jnp.sum(self.q[:, None, :] * self.k[None, :, :] * E, axis=2)
        F = pair_decay(self.B) if self.has_b else None
        return E, P, F


def _slot():
    """Flat index of this program's (slot, row) in the scalar tables, and the slot."""
    r, s = pl.program_id(0), pl.program_id(3)
    return s * pl.num_programs(0) + r, s


def forward_kernel(first_ref, seq_ref, last_ref, q_ref, k_ref, v_ref, a_ref, *refs, has_b, states):
    """One chunk forward: o = (q e^A) S e^B + intra; S <- decay(S) + (k e^{At-A})^T (v e^{Bt-B}).
    Outputs o [C, BV], the running final state (written every chunk of the sequence),
    and with `states` the state entering each chunk [Kp, BV]."""
    refs = list(refs)
    b_ref = refs.pop(0) if has_b else None
    h0_ref, o_ref, fin_ref = refs[:3]
    hs_ref = refs[3] if states else None
    s_scr = refs[-1]
    i, s = _slot()

    @pl.when((first_ref[i] != 0) | (s == 0))
    def _():
        s_scr[...] = h0_ref[...]

    S = s_scr[...]
    if states:
        hs_ref[...] = S
    q, k, v = q_ref[...], k_ref[...], v_ref[...]
    c = Chunk(q, k, a_ref[...], b_ref[...] if has_b else None)
    _, P, F = c.weights()
    o = mm(q * c.eA, S)
    if has_b:
        o = o * c.eB + jnp.sum(P[:, :, None] * v[None, :, :] * F, axis=1)
        vd = v * c.eBr
    else:
        o = o + mm(P, v)
        vd = v
    o_ref[...] = o
    S = c.decay_state(S) + mm_tn(k * c.eAr, vd)
    s_scr[...] = S
    fin_ref[...] = S


def state_grad_kernel(first_ref, seq_ref, last_ref, q_ref, a_ref, *refs, has_b):
    """Reverse pass over chunks (slots are visited last to first by the index maps):
    dS_in = decay(dS_out) + (q e^A)^T (do e^B). Writes dS_out of every chunk and,
    every chunk, the running gradient of the sequence's initial state."""
    refs = list(refs)
    b_ref = refs.pop(0) if has_b else None
    do_ref, dfin_ref, dh_ref, dh0_ref, d_scr = refs
    r, j = pl.program_id(0), pl.program_id(3)
    s = pl.num_programs(3) - 1 - j
    i = s * pl.num_programs(0) + r

    @pl.when((last_ref[i] != 0) | (j == 0))
    def _():
        d_scr[...] = dfin_ref[...]

    dS = d_scr[...]
    dh_ref[...] = dS
    q = q_ref[...]
    c = Chunk(q, q, a_ref[...], b_ref[...] if has_b else None)
    do = do_ref[...]
    dob = do * c.eB if has_b else do
    dS = c.decay_state(dS) + mm_tn(q * c.eA, dob)
    d_scr[...] = dS
    dh0_ref[...] = dS


def chunk_grad_kernel(first_ref, seq_ref, last_ref, q_ref, k_ref, v_ref, a_ref, *refs, has_b):
    """Gradients inside one chunk given the state entering it (S) and the gradient
    of the state leaving it (dS). Gate gradients sum, per pair (s, u) of the
    recurrence, its contribution over the gates s < t <= u it spans: pairs from
    before the chunk (q.dq_inter, reverse cumsum), pairs to after it (k.dk_inter,
    exclusive cumsum), pairs passing through (constant) and in-chunk pairs with
    s < u only (the diagonal's O(1) q.k terms would cancel: left out exactly)."""
    refs = list(refs)
    b_ref = refs.pop(0) if has_b else None
    do_ref, S_ref, dS_ref = refs[:3]
    outs = refs[3:]
    dq_ref, dk_ref, da_ref, dv_ref = outs[:4]
    q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
    S, dS = S_ref[...], dS_ref[...]
    c = Chunk(q, k, a_ref[...], b_ref[...] if has_b else None)
    C = c.C
    E, P, F = c.weights()
    dob = do * c.eB if has_b else do
    vd = v * c.eBr if has_b else v
    kd = k * c.eAr
    dq_inter = c.eA * mm_nt(dob, S)
    dk_inter = c.eAr * mm_nt(vd, dS)
    dv_inter = mm(kd, dS)
    if has_b:
        dv_inter = dv_inter * c.eBr
        dP = jnp.sum(do[:, None, :] * v[None, :, :] * F, axis=2)
        dv_intra = jnp.sum(P[:, :, None] * do[:, None, :] * F, axis=0)
    else:
        dP = mm_nt(do, v)
        dv_intra = mm_tn(P, do)
    dP = dP * tri(C)
    dq = dq_inter + jnp.sum(dP[:, :, None] * k[None, :, :] * E, axis=1)
    dk = dk_inter + jnp.sum(dP[:, :, None] * q[:, None, :] * E, axis=0)
    dq_ref[...] = dq
    dk_ref[...] = dk
    dv_ref[...] = dv_inter + dv_intra

    U, Ls = tri(C, upper=True), tri(C, strict=True)
    strict = tri(C, strict=True)
    X = (dP * strict)[:, :, None] * q[:, None, :] * k[None, :, :] * E  # [u, s, Kp]
    Sb = S * jnp.exp(c.Bt) if has_b else S
    through = jnp.exp(c.At) * mm_nt(jnp.ones((C, S.shape[1]), F32), Sb * dS)
    da_ref[...] = (mm(U, q * dq_inter + jnp.sum(X, 1) - jnp.sum(X, 0)) + mm(Ls, k * dk_inter)
                   + through)
    if has_b:
        db_ref = outs[4]
        o_inter = mm(q * c.eA, S) * c.eB
        Y = (P * strict)[:, :, None] * v[None, :, :] * do[:, None, :] * F
        through_b = mm(jnp.ones((C, S.shape[0]), F32) * jnp.exp(c.At), S * dS) * jnp.exp(c.Bt)
        db_ref[...] = (mm(U, do * o_inter + jnp.sum(Y, 1) - jnp.sum(Y, 0))
                       + mm(Ls, v * dv_inter) + through_b)
