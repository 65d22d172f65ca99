"""The float64 oracle (parity/oracle.py) against independent computations:
central finite differences for every gradient, the identities SPEC.md implies
(varlen, reverse, grouped heads, gate forms, splitting), and closed forms."""

import numpy as np
import pytest

from bridge.contract import INPUTS, TOKENS  # the inputs; those with a time axis
from parity import cases, oracle


def make_inputs(seed=0, **fields):
    """Float64 keyword arguments of `recurrent` (with cu_seqlens for packed sequences),
    then the cotangents do and dfinal_state, of `parity.cases.Case(**fields)` with small
    defaults (B=2, or 1 with seqlens; T=5, H=Hk=2, K=3, V=4)."""
    small = dict(B=1 if fields.get("seqlens") else 2, T=5, K=3, V=4)
    _, arrays = cases.make(seed, **dict(small, **fields))
    kw, cot = cases.split(cases.cast(arrays, np.float64))
    return kw, cot["do"], cot["dfinal_state"]


def jacobians(kw, name, eps=1e-6):
    """Central differences of (o, final_state) w.r.t. every element of kw[name]:
    arrays of shape x.shape + o.shape and x.shape + final_state.shape."""
    x = kw[name] = kw[name].copy()
    o, s = oracle.recurrent(**kw)
    jo, js = np.zeros(x.shape + o.shape), np.zeros(x.shape + s.shape)
    for i in np.ndindex(x.shape):
        orig = x[i]
        x[i] = orig + eps
        o_up, s_up = oracle.recurrent(**kw)
        x[i] = orig - eps
        o_dn, s_dn = oracle.recurrent(**kw)
        x[i] = orig
        jo[i] = (o_up - o_dn) / (2 * eps)
        js[i] = (s_up - s_dn) / (2 * eps)
    return jo, js


def contract(jac, cot):
    return np.tensordot(jac, cot, axes=cot.ndim)


FD_CONFIGS = {
    # grouped heads, every gate in its full form, g_gamma [H], explicit scale
    "gqa-key-gates": dict(B=2, T=4, H=4, Hk=2, K=3, V=2, g="key", gk=True, gv=True,
                          g_gamma="head", initial_state=True),
    # g as [B,T,H], g_gamma as [N,H], reverse
    "head-gate-reverse": dict(B=2, T=5, H=2, Hk=1, K=3, V=4, g="head", gv=True,
                              g_gamma="seq", initial_state=True),
    # packed varlen with a zero-length sequence
    "varlen-packed": dict(H=2, Hk=1, K=3, V=2, seqlens=(3, 0, 2), packed=True, g="key",
                          gk=True, gv=True, g_gamma="seq", initial_state=True),
    # [1,total,...] varlen, reverse, [H] g_gamma, g per head
    "varlen-batched-reverse": dict(H=2, Hk=2, K=2, V=3, seqlens=(2, 3, 0), g="head",
                                   g_gamma="head", initial_state=True),
}
FD_EXTRA = {"gqa-key-gates": dict(softmax_scale=0.7), "head-gate-reverse": dict(reverse=True),
            "varlen-packed": {}, "varlen-batched-reverse": dict(reverse=True)}


@pytest.mark.parametrize("config", list(FD_CONFIGS))
def test_gradients_match_finite_differences(config):
    kw, do, dfs = make_inputs(seed=1, **FD_CONFIGS[config])
    kw.update(FD_EXTRA[config])
    given = [n for n in INPUTS if n in kw]
    zero_do, zero_dfs = np.zeros_like(do), np.zeros_like(dfs)
    paths = {"o only": (do, None), "final_state only": (zero_do, dfs), "both": (do, dfs)}
    got = {p: oracle.recurrent_grads(**kw, do=a, dfinal_state=b) for p, (a, b) in paths.items()}
    for name in given:
        jo, js = jacobians(kw, name)
        for path, (a, b) in paths.items():
            assert sorted(got[path]) == sorted(given)
            want = contract(jo, a) + contract(js, zero_dfs if b is None else b)
            assert got[path][name].shape == kw[name].shape, (name, path)
            np.testing.assert_allclose(got[path][name], want, rtol=1e-6, atol=1e-8,
                                       err_msg=f"{config}: d{name} through {path}")


def slice_time(kw, sl, axis):
    return {n: (x[(slice(None),) * axis + (sl,)] if n in TOKENS else x)
            for n, x in kw.items()}


@pytest.mark.parametrize("reverse", [False, True])
def test_varlen_equals_separate_calls(reverse):
    seqlens = (3, 0, 4, 1)
    kw, _, _ = make_inputs(seed=2, H=2, Hk=1, seqlens=seqlens, packed=True, g="key", gv=True,
                           g_gamma="seq", initial_state=True)
    o, s = oracle.recurrent(**kw, reverse=reverse)
    batched = {n: (x[None] if n in TOKENS else x) for n, x in kw.items()}
    o_b, s_b = oracle.recurrent(**batched, reverse=reverse)
    assert o.shape == kw["q"].shape[:-1] + (4,) and o_b.shape == (1,) + o.shape
    np.testing.assert_array_equal(o_b[0], o)
    np.testing.assert_array_equal(s_b, s)
    cu = kw["cu_seqlens"]
    for i in range(len(seqlens)):
        part = slice_time(batched, slice(cu[i], cu[i + 1]), 1)
        del part["cu_seqlens"]
        part.update(g_gamma=kw["g_gamma"][i], initial_state=kw["initial_state"][i:i + 1])
        oi, si = oracle.recurrent(**part, reverse=reverse)
        np.testing.assert_allclose(o[cu[i]:cu[i + 1]], oi[0], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(s[i], si[0], rtol=1e-12, atol=1e-12)


def test_zero_length_sequence_returns_its_initial_state():
    kw, do, dfs = make_inputs(seed=3, seqlens=(2, 0, 3, 0), packed=True, g="key", gv=True,
                              g_gamma="head", initial_state=True)
    for reverse in (False, True):
        _, s = oracle.recurrent(**kw, reverse=reverse)
        for i in (1, 3):
            np.testing.assert_array_equal(s[i], kw["initial_state"][i])
        grads = oracle.recurrent_grads(**kw, reverse=reverse, do=do, dfinal_state=dfs)
        for i in (1, 3):
            np.testing.assert_array_equal(grads["initial_state"][i], dfs[i])
    # every sequence empty: no tokens at all
    empty = dict(q=np.zeros((0, 2, 3)), k=np.zeros((0, 2, 3)), v=np.zeros((0, 2, 4)),
                 initial_state=kw["initial_state"][:2], cu_seqlens=np.array([0, 0, 0]))
    o, s = oracle.recurrent(**empty)
    assert o.shape == (0, 2, 4)
    np.testing.assert_array_equal(s, kw["initial_state"][:2])


def test_reverse_equals_flipping_time():
    kw, do, _ = make_inputs(seed=4, g="key", gk=True, gv=True, g_gamma="head",
                            initial_state=True)
    o, s = oracle.recurrent(**kw, reverse=True)
    flipped = {n: (x[:, ::-1] if n in TOKENS else x) for n, x in kw.items()}
    o_f, s_f = oracle.recurrent(**flipped)
    np.testing.assert_allclose(o, o_f[:, ::-1], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(s, s_f, rtol=1e-12, atol=1e-12)
    g_r = oracle.recurrent_grads(**kw, reverse=True, do=do)
    g_f = oracle.recurrent_grads(**flipped, do=do[:, ::-1])
    for n in TOKENS:
        np.testing.assert_allclose(g_r[n], g_f[n][:, ::-1], rtol=1e-12, atol=1e-12)


def test_grouped_heads_equal_repeated_kv_heads():
    kw, do, dfs = make_inputs(seed=5, H=4, Hk=2, g="key", gv=True, initial_state=True)
    rep = dict(kw, k=np.repeat(kw["k"], 2, axis=2), v=np.repeat(kw["v"], 2, axis=2))
    o1, s1 = oracle.recurrent(**kw)
    o2, s2 = oracle.recurrent(**rep)
    np.testing.assert_allclose(o1, o2, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(s1, s2, rtol=1e-13, atol=1e-13)
    g1 = oracle.recurrent_grads(**kw, do=do, dfinal_state=dfs)
    g2 = oracle.recurrent_grads(**rep, do=do, dfinal_state=dfs)
    for n in ("k", "v"):  # a kv head's gradient sums over the query heads reading it
        B, T, Hk, D = g1[n].shape
        np.testing.assert_allclose(g1[n], g2[n].reshape(B, T, Hk, 2, D).sum(axis=3),
                                   rtol=1e-12, atol=1e-12)
    for n in ("q", "g", "gv", "initial_state"):
        np.testing.assert_allclose(g1[n], g2[n], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("packed", [False, True])
def test_head_gate_equals_its_broadcast(packed):
    seqlens = (2, 3) if packed else None
    kw, do, dfs = make_inputs(seed=6, g="head", seqlens=seqlens, packed=packed)
    K = kw["q"].shape[-1]
    wide = dict(kw, g=np.repeat(kw["g"][..., None], K, axis=-1))
    for a, b in zip(oracle.recurrent(**kw), oracle.recurrent(**wide)):
        np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-13)
    narrow_g = oracle.recurrent_grads(**kw, do=do, dfinal_state=dfs)["g"]
    wide_g = oracle.recurrent_grads(**wide, do=do, dfinal_state=dfs)["g"]
    assert narrow_g.shape == kw["g"].shape and wide_g.shape == wide["g"].shape
    np.testing.assert_allclose(narrow_g, wide_g.sum(axis=-1), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("reverse", [False, True])
def test_split_with_state_passed_on(reverse):
    kw, _, _ = make_inputs(seed=7, T=7, g="key", gk=True, gv=True, g_gamma="head",
                           initial_state=True)
    o, s = oracle.recurrent(**kw, reverse=reverse)
    cut = 3
    first, second = slice_time(kw, slice(0, cut), 1), slice_time(kw, slice(cut, None), 1)
    if reverse:  # the later tokens are consumed first
        first, second = second, first
    o1, s1 = oracle.recurrent(**first, reverse=reverse)
    o2, s2 = oracle.recurrent(**dict(second, initial_state=s1), reverse=reverse)
    joined = np.concatenate([o2, o1] if reverse else [o1, o2], axis=1)
    np.testing.assert_allclose(joined, o, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(s2, s, rtol=1e-12, atol=1e-12)


def test_lightning_attn_is_recurrent_with_spec_decay():
    kw, _, _ = make_inputs(seed=8, H=5, Hk=1, initial_state=True)
    q, k, v, h0 = kw["q"], kw["k"], kw["v"], kw["initial_state"]
    H, layer_idx, num_layers = 5, 2, 7
    g_gamma = -(8 / H * (1 - layer_idx / num_layers)) * np.arange(H, dtype=np.float32)
    for reverse in (False, True):
        got = oracle.lightning_attn(q, k, v, layer_idx, num_layers, softmax_scale=0.4,
                                    initial_state=h0, reverse=reverse)
        want = oracle.recurrent(q, k, v, g_gamma=g_gamma, softmax_scale=0.4,
                                initial_state=h0, reverse=reverse)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)
    # the last layer has no decay at all: plain causal linear attention
    got = oracle.lightning_attn(q, k, v, num_layers, num_layers)
    want = oracle.recurrent(q, k, v)
    np.testing.assert_array_equal(got[0], want[0])


def test_recurrent_gla_is_recurrent_with_key_gate():
    kw, _, _ = make_inputs(seed=9, g="key", g_gamma="head", initial_state=True)
    got = oracle.recurrent_gla(**kw, softmax_scale=0.6, reverse=True)
    for want in (oracle.recurrent(**kw, softmax_scale=0.6, reverse=True),
                 oracle.recurrent(**dict(kw, g=None, gk=kw["g"]), softmax_scale=0.6,
                                  reverse=True)):
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-13)


def test_closed_form_without_gates_is_causal_linear_attention():
    kw, _, _ = make_inputs(seed=10, B=2, T=6, H=2, Hk=2, K=3, V=4)
    q, k, v = kw["q"], kw["k"], kw["v"]
    T, scale = q.shape[1], 3 ** -0.5
    tril = np.tril(np.ones((T, T)))
    o, s = oracle.recurrent(q, k, v)
    for b in range(2):
        for h in range(2):
            qh, kh, vh = q[b, :, h], k[b, :, h], v[b, :, h]
            np.testing.assert_allclose(o[b, :, h], scale * ((qh @ kh.T) * tril) @ vh,
                                       rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(s[b, h], kh.T @ vh, rtol=1e-12, atol=1e-12)


def test_closed_form_constant_scalar_gate():
    kw, _, _ = make_inputs(seed=11, B=2, T=6, H=2, Hk=2, K=3, V=4)
    q, k, v = kw["q"], kw["k"], kw["v"]
    B, T, H, _ = q.shape
    c, scale = -0.3, 0.5
    t = np.arange(T)
    decay = np.exp(c * (t[:, None] - t[None, :])) * (t[:, None] >= t[None, :])
    o, _ = oracle.recurrent(q, k, v, g=np.full((B, T, H), c), softmax_scale=scale)
    o_gamma, _ = oracle.recurrent(q, k, v, g_gamma=np.full(H, c), softmax_scale=scale)
    for b in range(B):
        for h in range(H):
            want = scale * ((q[b, :, h] @ k[b, :, h].T) * decay) @ v[b, :, h]
            np.testing.assert_allclose(o[b, :, h], want, rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(o_gamma[b, :, h], want, rtol=1e-12, atol=1e-12)


def test_closed_form_all_gates_and_initial_state():
    """Unrolled: o_t = scale [(q_t e^{A_t}) h0 e^{B_t} + sum_{s<=t} (q_t e^{A_t-A_s}) . k_s
    (v_s e^{B_t-B_s})] with A, B the cumulative sums of a, b over the steps."""
    kw, _, _ = make_inputs(seed=12, B=2, T=5, H=4, Hk=2, K=3, V=4, g="key", gk=True,
                           gv=True, g_gamma="seq", initial_state=True)
    o, s = oracle.recurrent(**kw)
    B, T, H, K = kw["q"].shape
    for b in range(B):
        for h in range(H):
            a = kw["g"][b, :, h] + kw["gk"][b, :, h] + kw["g_gamma"][b, h]
            A, Bv = np.cumsum(a, axis=0), np.cumsum(kw["gv"][b, :, h], axis=0)
            qh, kh, vh = kw["q"][b, :, h], kw["k"][b, :, h // 2], kw["v"][b, :, h // 2]
            h0 = kw["initial_state"][b, h]
            for t in range(T):
                want = (qh[t] * np.exp(A[t])) @ h0 * np.exp(Bv[t])
                for r in range(t + 1):
                    want = want + (((qh[t] * np.exp(A[t] - A[r])) @ kh[r]) * vh[r]
                                   * np.exp(Bv[t] - Bv[r]))
                np.testing.assert_allclose(o[b, t, h], K ** -0.5 * want, rtol=1e-12, atol=1e-12)
            state = np.exp(A[-1])[:, None] * h0 * np.exp(Bv[-1])[None, :] + sum(
                np.outer(kh[r] * np.exp(A[-1] - A[r]), vh[r] * np.exp(Bv[-1] - Bv[r]))
                for r in range(T))
            np.testing.assert_allclose(s[b, h], state, rtol=1e-12, atol=1e-12)


def test_bfloat16_input_equals_its_float64_upcast():
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 NumPy arrays need ml_dtypes")
    kw, do, _ = make_inputs(seed=13, g="key", gv=True, initial_state=True)
    low = {n: x.astype(ml_dtypes.bfloat16) for n, x in kw.items()}
    up = {n: x.astype(np.float64) for n, x in low.items()}
    assert not np.array_equal(up["q"], kw["q"])  # the rounding is real
    o_low, s_low = oracle.recurrent(**low)
    o_up, s_up = oracle.recurrent(**up)
    assert o_low.dtype == s_low.dtype == np.float64
    np.testing.assert_array_equal(o_low, o_up)
    np.testing.assert_array_equal(s_low, s_up)
    g_low = oracle.recurrent_grads(**low, do=do.astype(ml_dtypes.bfloat16))
    g_up = oracle.recurrent_grads(**up, do=do.astype(ml_dtypes.bfloat16).astype(np.float64))
    for n in g_up:
        assert g_low[n].dtype == np.float64
        np.testing.assert_array_equal(g_low[n], g_up[n])
