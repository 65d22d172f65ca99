"""Pallas kernel bodies for one chunk of gated linear attention (TPU / interpret).

Every body sees one chunk of C = 64 tokens of one (row, head, value block):
q, k [C, K] and v, do [C, BV] in the input dtype, a [C, K] key-side and b [C, BV]
value-side log gates (b optional) in float32, the state [K, BV] in float32.

MXU products take the input dtype's operands (bf16 stays bf16; fp16 and fp32
take fp32 operands at HIGHEST: TPUs have no fp16 MXU path) with fp32
accumulation. Decays are fp32 and every exponent is a sum of consecutive log
gates (<= 0), never a difference of long running sums: running sums inside
16-token sub-chunks and the sub-chunk totals, formed on the vector unit
(log-step rolls), give the decays from the chunk start, to the chunk end, and
for the pairs inside the chunk. A pair (t, s) in different sub-chunks
j = sub(s) < i = sub(t) factors as e^{t's sub-chunk start..t} * e^{the
sub-chunks strictly between} * e^{after s..end of sub-chunk j}: three factors
<= 1. With key-wise gates the in-chunk matrix then comes from C-row matmuls
(one per column sub-chunk j) and the four 16 x 16 diagonal blocks from an
elementwise [16, 16, D] pair decay; with one gate per token (per-head g,
g_gamma: `scalar`) it is one [C, C] product (q k^T) * W.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

F32 = jnp.float32
HI = lax.Precision.HIGHEST
C = 64  # tokens per chunk
SUB = 16  # tokens per sub-chunk: the reference spacing of the gate exponentials
NSUB = C // SUB


def operand_dtype(dtype):
    """The MXU operand dtype for inputs of `dtype`: bf16 stays, others take fp32."""
    return jnp.bfloat16 if jnp.dtype(dtype) == jnp.bfloat16 else F32


def _dot(x, y, dims, od):
    x, y = x.astype(od), y.astype(od)
    return lax.dot_general(x, y, (dims, ((), ())), preferred_element_type=F32,
                           precision=HI if od == F32 else None)


def mm(x, y, od=F32):
    """x @ y with operands in `od` (fp32: HIGHEST)."""
    return _dot(x, y, ((1,), (0,)), od)


def mm_tn(x, y, od=F32):
    """x^T @ y (contract the leading dims)."""
    return _dot(x, y, ((0,), (0,)), od)


def mm_nt(x, y, od=F32):
    """x @ y^T (contract the trailing dims)."""
    return _dot(x, y, ((1,), (1,)), od)


def _iota2(n, m):
    return lax.broadcasted_iota(jnp.int32, (n, m), 0), lax.broadcasted_iota(jnp.int32, (n, m), 1)


def column(row):
    """[1, D] -> [D, 1] without a transpose: diag(row) summed over lanes."""
    D = row.shape[-1]
    r, c = _iota2(D, D)
    return jnp.sum(jnp.where(r == c, jnp.broadcast_to(row, (D, D)), 0.0), axis=1, keepdims=True)


def sub_rows(j, D):
    """[C, D] mask of the rows of sub-chunk j."""
    r = lax.broadcasted_iota(jnp.int32, (C, D), 0)
    return (r >= j * SUB) & (r < (j + 1) * SUB)


def scan(x, seg=C, reverse=False, exclusive=False):
    """Running sums of x [C, D] down the rows (up with `reverse`) inside segments of
    `seg` rows, inclusive or exclusive: log-step rolls on the vector unit (a selector
    matmul would cost the MXU six fp32 passes of C rows for a few adds)."""
    n = x.shape[0]
    pos = lax.rem(lax.broadcasted_iota(jnp.int32, x.shape, 0), jnp.int32(seg))
    if reverse:
        pos = seg - 1 - pos
    def shift(y, s):  # row t gets row t - s (t + s with `reverse`)
        return pltpu.roll(y, n - s if reverse else s, 0)

    y, s = x, 1
    while s < seg:
        y = y + jnp.where(pos >= s, shift(y, s), 0.0)
        s *= 2
    return jnp.where(pos >= 1, shift(y, 1), 0.0) if exclusive else y


def _rows(vals, D):
    """[C, D] whose rows of sub-chunk m hold vals[m] ([1, D] or [1, 1]; None: 0)."""
    return jnp.concatenate([jnp.zeros((SUB, D), F32) if v is None else jnp.broadcast_to(v, (SUB, D))
                            for v in vals], axis=0)


def _sum(vals):
    out = vals[0]
    for v in vals[1:]:
        out = out + v
    return out


class _Sums:
    """Sums of consecutive log gates x [C, D], all by vector adds: local [C, D] from t's
    sub-chunk start to t, tail [C, D] after t to its sub-chunk end, totals T[m]
    [1, D] of each sub-chunk, and per row t of sub-chunk i: before (T[:i]) and
    after (T[i+1:]); each <= 0, none a difference of two sums."""

    def __init__(self, x):
        D = x.shape[1]
        self.D = D
        self.local = scan(x, SUB)
        self.tail = scan(x, SUB, reverse=True, exclusive=True)
        self.T = [self.local[m * SUB + SUB - 1:m * SUB + SUB] for m in range(NSUB)]
        self.tot = _sum(self.T)
        self.before = _rows([None] + [_sum(self.T[:m]) for m in range(1, NSUB)], D)
        self.after = _rows([_sum(self.T[m + 1:]) for m in range(NSUB - 1)] + [None], D)

    def between(self, j):
        """[C, D] for rows of sub-chunks i > j: T[j+1:i] (0 for i = j + 1); None before."""
        zero = jnp.zeros((1, self.D), F32)
        return _rows([None] * (j + 1) + [zero if i == j + 1 else _sum(self.T[j + 1:i])
                                         for i in range(j + 1, NSUB)], self.D)


class Decay:
    """The exponentials of one side's log gates x [C, D] over one chunk.

    start [C, D] e^{x_0 + .. + x_t}; total [1, D] and total_col [D, 1] the whole
    chunk's e^{sum x}; with `inner` also end [C, D] e^{x_{t+1} + .. + x_{C-1}};
    head [C, D] e^{sum from t's sub-chunk start to t}; tail [C, D] e^{sum after t
    to its sub-chunk end}; between[j] [C, D] e^{sum over the sub-chunks strictly
    between j and sub(t)} for rows of sub-chunks after j, else 0;
    x [C, D] the gates themselves (for the diagonal blocks' pair decays).
    """

    def __init__(self, x, inner=True):
        sm = _Sums(x)
        self.total, self.total_col = jnp.exp(sm.tot), jnp.exp(column(sm.tot))
        self.start = jnp.exp(sm.before + sm.local)
        if not inner:
            return
        tail = sm.tail
        self.x = x
        self.end = jnp.exp(sm.after + tail)
        self.head, self.tail = jnp.exp(sm.local), jnp.exp(tail)
        rows = lax.broadcasted_iota(jnp.int32, x.shape, 0)
        self.between = [jnp.where(rows >= (j + 1) * SUB, jnp.exp(sm.between(j)), 0.0)
                        for j in range(NSUB - 1)]

    def pairs(self, i):
        """[SUB(t), SUB(s), D] e^{x_{s+1} + .. + x_t} for s < t inside sub-chunk i, else 0
        (the pairs s = t have weight 1 and are handled whole, see Intra)."""
        x = self.x[i * SUB:(i + 1) * SUB]
        s = lax.broadcasted_iota(jnp.int32, (SUB, x.shape[1]), 0)
        # row t's sums over (s, t] by adding x_t to row t - 1's: sums, not differences of
        # running sums (which keep only |gate| * eps after a gate far below zero)
        rows, r = [], jnp.zeros_like(x)
        for t in range(SUB):
            r = jnp.where(s < t, r + x[t:t + 1], 0.0)
            rows.append(jnp.where(s < t, jnp.exp(r), 0.0))
        return jnp.stack(rows)


def row(col):
    """[C, 1] -> [1, C] without a transpose."""
    n = col.shape[0]
    r, c = _iota2(n, n)
    return jnp.sum(jnp.where(r == c, jnp.broadcast_to(col, (n, n)), 0.0), axis=0, keepdims=True)


class ScalarDecay:
    """Decay's quantities for one log gate per token (x [C, 1]: per-head gates,
    g_gamma): start, end [C, 1], total = total_col [1, 1], and W [C, C]
    e^{x_{s+1} + .. + x_t} for s <= t (else 0), factored like the key-wise pairs:
    inside a sub-chunk a running sum down the rows from s + 1, across sub-chunks
    (t's part of its sub-chunk) + (whole sub-chunks between) + (s's rest of its)."""

    def __init__(self, x, weights=True):
        sm = _Sums(x)
        self.total = self.total_col = jnp.exp(sm.tot)
        tail = sm.tail
        self.start, self.end = jnp.exp(sm.before + sm.local), jnp.exp(sm.after + tail)
        if not weights:
            return
        r, c = _iota2(C, C)
        si, sj = lax.div(r, jnp.int32(SUB)), lax.div(c, jnp.int32(SUB))
        btw = jnp.zeros((C, C), F32)
        for i in range(2, NSUB):
            for j in range(i - 1):
                btw = jnp.where((si == i) & (sj == j), _sum(sm.T[j + 1:i]), btw)
        # inside a sub-chunk: sums over (s, t] down the rows, never local_t - local_s
        inner = scan(jnp.where(c < r, jnp.broadcast_to(x, (C, C)), 0.0), SUB)
        D = jnp.where(si == sj, inner, sm.local + btw + row(tail))
        self.W = jnp.where(c <= r, jnp.exp(jnp.where(c <= r, D, 0.0)), 0.0)


def _blk(x, i):
    return x[i * SUB:(i + 1) * SUB]


class Intra:
    """The in-chunk (s <= t) part of o for one chunk, and what its gradient reuses.

    Off-diagonal sub-chunk pairs: P[j] [C, C] = (q head between[j]) (k tail)^T on
    the columns of sub-chunk j; diagonal blocks: Pd[i] [SUB, SUB] elementwise over
    s < t; the pairs s = t: Ptt [C, 1] = q_t . k_t. Keeping s = t apart lets the
    gate gradients leave its O(1) terms out exactly (they cancel in dA).
    """

    def __init__(self, q, k, da, od):
        self.kt = k * da.tail
        qh = q * da.head
        self.qj = [qh * w for w in da.between]
        self.P = [mm_nt(qj, jnp.where(sub_rows(j, k.shape[1]), self.kt, 0.0), od)
                  for j, qj in enumerate(self.qj)]
        self.F = [da.pairs(i) for i in range(NSUB)]
        self.Pd = [jnp.sum(_blk(q, i)[:, None, :] * _blk(k, i)[None, :, :] * self.F[i], axis=2)
                   for i in range(NSUB)]
        self.Ptt = jnp.sum(q * k, axis=1, keepdims=True)

    def off(self, v, vr, db, od):
        """The off-diagonal blocks' sum_s P[t, s] v_s (e^{b_{s+1} + .. + b_t}): [C, BV];
        vr is v in the input dtype (the MXU operand when there is no value gate)."""
        if db is None:
            return mm(sum(self.P), vr, od)
        vt = v * db.tail
        return db.head * sum(w * mm(P, vt, od) for w, P in zip(db.between, self.P))

    def diag(self, i, v, vr, db, od):
        """Diagonal block i's part of the output: [SUB, BV]."""
        if db is None:
            return mm(self.Pd[i], _blk(vr, i), od)
        return jnp.sum(self.Pd[i][:, :, None] * _blk(v, i)[None] * db.pairs(i), axis=1)

    def output(self, v, vr, db, od):
        """sum_{s <= t} P[t, s] v_s (e^{b_{s+1} + .. + b_t}): [C, BV]."""
        diag = [self.diag(i, v, vr, db, od) for i in range(NSUB)]
        return self.off(v, vr, db, od) + jnp.concatenate(diag, axis=0) + self.Ptt * v


def _store(ref, x):
    ref[...] = x.astype(ref.dtype)


def _slot():
    """Flat index of this program's (slot, row) in the scalar tables, and the slot."""
    r, s = pl.program_id(0), pl.program_id(3)
    return s * pl.num_programs(0) + r, s


def _load(q_ref, k_ref, v_ref, a_ref, b_ref, scale, scalar):
    q, k, v = q_ref[...], k_ref[...], v_ref[...]
    od = operand_dtype(q.dtype)
    da = ScalarDecay(a_ref[...]) if scalar else Decay(a_ref[...])
    db = Decay(b_ref[...]) if b_ref is not None else None
    return q.astype(F32) * scale, k.astype(F32), v.astype(F32), v, da, db, od


def forward_kernel(first_ref, seq_ref, last_ref, q_ref, k_ref, v_ref, a_ref, *refs, has_b,
                   states, scale, scalar):
    """One chunk forward: o = (q e^A) S e^B + intra;
    S <- e^{A_C} S e^{B_C} + (k e^{A_C-A})^T (v e^{B_C-B}).
    Outputs o [C, BV], the running final state (written every chunk of the sequence),
    and with `states` the state entering each chunk [K, BV]."""
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
        hs_ref[...] = S.astype(hs_ref.dtype)
    q, k, v, vr, da, db, od = _load(q_ref, k_ref, v_ref, a_ref, b_ref, scale, scalar)
    if scalar:  # one [C, C] weight matrix: products of the raw (exact) operands
        qr, kr = q_ref[...], k_ref[...]
        o = (da.start * scale) * mm(qr, S, od)
        o = o + mm(mm_nt(qr, kr, od) * (da.W * scale), vr, od)
    else:
        o = mm(q * da.start, S, od)
        if db is not None:
            o = o * db.start
        o = o + Intra(q, k, da, od).output(v, vr, db, od)
    o_ref[...] = o.astype(o_ref.dtype)
    S = S * da.total_col
    if db is not None:
        S = S * db.total
    S = S + mm_tn(k * da.end, v * db.end if db is not None else vr, od)
    s_scr[...] = S
    fin_ref[...] = S


def state_grad_kernel(first_ref, seq_ref, last_ref, q_ref, a_ref, *refs, has_b, scale, scalar):
    """Reverse pass over chunks (slots are visited last to first by the index maps):
    dS_in = e^{A_C} dS_out e^{B_C} + (q e^A)^T (do e^B). Writes dS_out of every chunk
    and, every chunk, the running gradient of the sequence's initial state."""
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
    dh_ref[...] = dS.astype(dh_ref.dtype)
    q = q_ref[...]
    od = operand_dtype(q.dtype)
    da = ScalarDecay(a_ref[...], False) if scalar else Decay(a_ref[...], False)
    do = do_ref[...]
    dS = dS * da.total_col
    if has_b:
        db = Decay(b_ref[...], False)
        dS = dS * db.total
        do = do.astype(F32) * db.start
    dS = dS + mm_tn(q.astype(F32) * scale * da.start, do, od)
    d_scr[...] = dS
    dh0_ref[...] = dS


def chunk_grad_kernel(first_ref, seq_ref, last_ref, q_ref, k_ref, v_ref, a_ref, *refs, has_b,
                      scale, scalar):
    """Gradients inside one chunk given the state entering it (S) and the gradient of
    the state leaving it (dS). Gate gradients from the chunk-local identity
    dA_t = q_t dq_t - k_t dk_t (for the running key-side log decay A_t; the same
    with o, do, v, dv on the value side), summed from t to the chunk end by one
    matmul; the state terms enter as exclusive prefix sums plus one term through
    the whole chunk's decay, so no large term cancels another."""
    refs = list(refs)
    b_ref = refs.pop(0) if has_b else None
    do_ref, S_ref, dS_ref = refs[:3]
    dq_ref, dk_ref, da_ref, dv_ref = refs[3:7]
    if scalar:
        return _scalar_grads(q_ref, k_ref, v_ref, a_ref, do_ref, S_ref, dS_ref, dq_ref, dk_ref,
                             da_ref, dv_ref, scale)
    q, k, v, vr, da, db, od = _load(q_ref, k_ref, v_ref, a_ref, b_ref, scale, scalar)
    dor = do_ref[...]
    do = dor.astype(F32)
    S, dS = S_ref[...].astype(F32), dS_ref[...].astype(F32)
    K, BV = q.shape[1], v.shape[1]
    intra = Intra(q, k, da, od)

    # through the state entering the chunk (S) and the state leaving it (dS)
    dob = do * db.start if db is not None else dor
    dq = da.start * mm_nt(dob, S, od)
    kE, vE = k * da.end, (v * db.end if db is not None else vr)
    dk_state = da.end * mm_nt(vE, dS, od)
    dv_state = mm(kE, dS, od)
    if db is not None:
        dv_state = dv_state * db.end

    # off-diagonal sub-chunk pairs
    dk = jnp.zeros((C, K), F32)
    if db is None:
        dP = mm_nt(dor, vr, od)
        dvt = mm_tn(sum(intra.P), dor, od)
        dPs = [dP] * (NSUB - 1)
    else:
        vt = v * db.tail
        Dj = [do * db.head * w for w in db.between]
        dPs = [mm_nt(d, vt, od) for d in Dj]
        dvt = db.tail * sum(mm_tn(P, d, od) for P, d in zip(intra.P, Dj))
    cols = lax.div(lax.broadcasted_iota(jnp.int32, (C, C), 1), jnp.int32(SUB))
    for j in range(NSUB - 1):
        dq = dq + da.head * da.between[j] * mm(jnp.where(cols == j, dPs[j], 0.0), intra.kt, od)
        dk = dk + jnp.where(sub_rows(j, K), mm_tn(dPs[j], intra.qj[j], od), 0.0)
    dk = dk * da.tail

    # diagonal blocks
    dq_d, dk_d, dv_d, o_d = [], [], [], []
    for i in range(NSUB):
        qi, ki, vi, doi = (_blk(x, i) for x in (q, k, v, do))
        F, Pd = intra.F[i], intra.Pd[i]
        if db is None:
            dPd = mm_nt(_blk(dor, i), _blk(vr, i), od)
            dv_d.append(mm_tn(Pd, _blk(dor, i), od))
        else:
            Fb = db.pairs(i)
            dPd = jnp.sum(doi[:, None, :] * vi[None, :, :] * Fb, axis=2)
            dv_d.append(jnp.sum(Pd[:, :, None] * doi[:, None, :] * Fb, axis=0))
            o_d.append(jnp.sum(Pd[:, :, None] * vi[None] * Fb, axis=1))
        dq_d.append(jnp.sum(dPd[:, :, None] * ki[None, :, :] * F, axis=1))
        dk_d.append(jnp.sum(dPd[:, :, None] * qi[:, None, :] * F, axis=0))
    dq = dq + jnp.concatenate(dq_d, axis=0)
    dk = dk + jnp.concatenate(dk_d, axis=0)
    dv_intra = dvt + jnp.concatenate(dv_d, axis=0)
    dPtt = jnp.sum(do * v, axis=1, keepdims=True)  # the pairs s = t
    _store(dq_ref, (dq + dPtt * k) * scale)
    _store(dk_ref, dk + dPtt * q + dk_state)
    _store(dv_ref, dv_state + dv_intra + intra.Ptt * do)

    # gate gradients (the pairs s = t left out): reverse sums inside the chunk,
    # exclusive prefix sums of the state-leaving terms, and the term through the
    # whole chunk's decay
    SdS = S * dS
    tb = db.total if db is not None else jnp.ones((1, BV), F32)
    through = da.total * mm_nt(jnp.broadcast_to(tb, (8, BV)), SdS)[0:1]
    da_ref[...] = (scan(q * dq - k * dk, reverse=True) + scan(k * dk_state, exclusive=True)
                   + through)
    if db is not None:
        db_ref = refs[7]
        o = (db.start * mm(q * da.start, S, od) + intra.off(v, vr, db, od)
             + jnp.concatenate(o_d, axis=0))
        through_b = db.total * mm(jnp.broadcast_to(da.total, (8, K)), SdS)[0:1]
        db_ref[...] = (scan(do * o - v * dv_intra, reverse=True)
                       + scan(v * dv_state, exclusive=True) + through_b)


def _scalar_grads(q_ref, k_ref, v_ref, a_ref, do_ref, S_ref, dS_ref, dq_ref, dk_ref, da_ref,
                  dv_ref, scale):
    """chunk_grad_kernel for one log gate per token (no value gate). The gate gradient
    sums the in-chunk pairs exactly: da_u += sum over t >= u > s of
    M[t, s] = W[t, s] (q_t . k_s) (do_t . v_s), from one matmul and a masked row sum;
    the pairs s = t never enter."""
    qr, kr, vr, dor = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
    od = operand_dtype(qr.dtype)
    q, k = qr.astype(F32) * scale, kr.astype(F32)
    S, dS = S_ref[...].astype(F32), dS_ref[...].astype(F32)
    da = ScalarDecay(a_ref[...])
    QK = mm_nt(qr, kr, od) * scale
    dPr = mm_nt(dor, vr, od)
    P, dP = QK * da.W, dPr * da.W
    dq_state = da.start * mm_nt(dor, S, od)
    dk_state = da.end * mm_nt(vr, dS, od)
    _store(dq_ref, (dq_state + mm(dP, kr, od)) * scale)
    _store(dk_ref, mm_tn(dP, qr, od) * scale + dk_state)
    _store(dv_ref, mm(kr.astype(F32) * da.end, dS, od) + mm_tn(P, dor, od))
    r, c = _iota2(C, C)
    pairs = jnp.sum(jnp.where(c < r, scan(P * dPr, reverse=True), 0.0), axis=1, keepdims=True)
    x = jnp.sum(q * dq_state, axis=1, keepdims=True)
    y = jnp.sum(k * dk_state, axis=1, keepdims=True)
    through = da.total * jnp.sum(jnp.sum(S * dS, axis=1, keepdims=True), axis=0, keepdims=True)
    da_ref[...] = scan(x, reverse=True) + scan(y, exclusive=True) + pairs + through
