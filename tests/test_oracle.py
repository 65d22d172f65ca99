"""The float64 oracle against finite differences, identities of SPEC.md and closed forms."""

import numpy as np
import pytest

from parity import cases, oracle

GRADS = ("q", "k", "v", "g", "gk", "gv", "g_gamma", "initial_state")


def args_of(case, seed=0):
    a = cases.inputs(case, seed)
    return {n: a[n].astype(np.float64) if n != "cu_seqlens" else a[n] for n in a}


def loss(kw, do, dstate):
    o, s = oracle.recurrent(**kw)
    return float((o * do).sum() + (0 if dstate is None else (s * dstate).sum()))


def finite_differences(kw, name, do, dstate, eps=1e-6):
    x = kw[name]
    grad = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        orig = x[i]
        x[i] = orig + eps
        up = loss(kw, do, dstate)
        x[i] = orig - eps
        down = loss(kw, do, dstate)
        x[i] = orig
        grad[i] = (up - down) / (2 * eps)
    return grad


FD_CASES = [
    cases.Case("fd-gates", B=2, T=4, H=2, Hk=1, K=3, V=2, g="key", gk=True, gv=True,
               g_gamma="head", initial_state=True),
    cases.Case("fd-head-gate-reverse", B=1, T=5, H=2, Hk=2, K=2, V=3, g="head",
               g_gamma="seq", initial_state=True, reverse=True),
    cases.Case("fd-varlen", H=2, Hk=1, K=2, V=2, seqlens=(3, 0, 2), g="key", gv=True,
               g_gamma="seq", initial_state=True, packed=True, softmax_scale=0.7),
]


@pytest.mark.parametrize("through", ["both", "o", "final_state"])
@pytest.mark.parametrize("case", FD_CASES, ids=lambda c: c.name)
def test_gradients_match_finite_differences(case, through):
    kw = cases.call_kwargs(case, args_of(case))
    a = args_of(case)
    do = a["do"] if through != "final_state" else np.zeros_like(a["do"])
    dstate = a["dfinal_state"] if through != "o" else None
    got = oracle.recurrent_grads(**kw, do=do, dfinal_state=dstate)
    given = [n for n in GRADS if n in kw]
    assert sorted(got) == sorted(given)
    for name in given:
        want = finite_differences(kw, name, do, dstate)
        assert got[name].shape == kw[name].shape, name
        np.testing.assert_allclose(got[name], want, rtol=1e-6, atol=1e-8, err_msg=name)


def test_varlen_equals_separate_calls():
    case = cases.Case("v", H=2, Hk=1, seqlens=(4, 0, 6, 1), g="key", gv=True, g_gamma="seq",
                      initial_state=True, packed=True)
    a = args_of(case)
    o, s = oracle.recurrent(**cases.call_kwargs(case, a))
    o_batched, s_batched = oracle.recurrent(**cases.call_kwargs(case, {
        n: x[None] if n in ("q", "k", "v", "g", "gv") else x for n, x in a.items()}))
    np.testing.assert_array_equal(o_batched[0], o)
    np.testing.assert_array_equal(s_batched, s)
    cu = a["cu_seqlens"]
    for i in range(len(cu) - 1):
        sl = slice(cu[i], cu[i + 1])
        oi, si = oracle.recurrent(a["q"][None, sl], a["k"][None, sl], a["v"][None, sl],
                                  g=a["g"][None, sl], gv=a["gv"][None, sl],
                                  g_gamma=a["g_gamma"][i], initial_state=a["initial_state"][i:i + 1])
        np.testing.assert_allclose(o[sl], oi[0], rtol=1e-13, atol=1e-13)
        np.testing.assert_allclose(s[i], si[0], rtol=1e-13, atol=1e-13)


def test_zero_length_sequence_returns_its_initial_state():
    case = cases.Case("z", seqlens=(3, 0, 2), g="key", initial_state=True, packed=True)
    a = args_of(case)
    _, s = oracle.recurrent(**cases.call_kwargs(case, a))
    np.testing.assert_array_equal(s[1], a["initial_state"][1])
    grads = oracle.recurrent_grads(**cases.call_kwargs(case, a), do=a["do"],
                                   dfinal_state=a["dfinal_state"])
    np.testing.assert_array_equal(grads["initial_state"][1], a["dfinal_state"][1])


def test_reverse_equals_flipping_time():
    case = cases.Case("r", B=2, g="key", gv=True, g_gamma="head", initial_state=True)
    a = args_of(case)
    o, s = oracle.recurrent(**cases.call_kwargs(case.with_(reverse=True), a))
    flipped = {n: x[:, ::-1] if n in ("q", "k", "v", "g", "gv") else x for n, x in a.items()}
    of, sf = oracle.recurrent(**cases.call_kwargs(case, flipped))
    np.testing.assert_allclose(o, of[:, ::-1], rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(s, sf, rtol=1e-13, atol=1e-13)


def test_grouped_heads_equal_repeated_heads():
    case = cases.Case("gqa", H=4, Hk=2, g="key")
    a = args_of(case)
    kw = cases.call_kwargs(case, a)
    rep = dict(kw, k=np.repeat(a["k"], 2, axis=2), v=np.repeat(a["v"], 2, axis=2))
    np.testing.assert_allclose(oracle.recurrent(**kw)[0], oracle.recurrent(**rep)[0], rtol=1e-13)
    g1 = oracle.recurrent_grads(**kw, do=a["do"], dfinal_state=a["dfinal_state"])
    g2 = oracle.recurrent_grads(**rep, do=a["do"], dfinal_state=a["dfinal_state"])
    for n in ("k", "v"):  # the kv-head gradient is the sum over its query heads
        np.testing.assert_allclose(g1[n], g2[n].reshape(g1[n].shape[:2] + (2, 2, -1)).sum(3),
                                   rtol=1e-12, atol=1e-13)


def test_head_gate_equals_its_broadcast():
    case = cases.Case("h", g="head")
    a = args_of(case)
    kw = cases.call_kwargs(case, a)
    wide = dict(kw, g=np.repeat(a["g"][..., None], case.K, axis=-1))
    np.testing.assert_allclose(oracle.recurrent(**kw)[0], oracle.recurrent(**wide)[0],
                               rtol=1e-13)
    g1 = oracle.recurrent_grads(**kw, do=a["do"])["g"]
    g2 = oracle.recurrent_grads(**wide, do=a["do"])["g"]
    assert g1.shape == a["g"].shape
    np.testing.assert_allclose(g1, g2.sum(-1), rtol=1e-12, atol=1e-13)


def test_split_with_state_passed_on():
    case = cases.Case("split", B=2, T=10, g="key", gv=True, g_gamma="head",
                      initial_state=True)
    a = args_of(case)
    o, s = oracle.recurrent(**cases.call_kwargs(case, a))
    cut = 4
    first = {n: x[:, :cut] if n in ("q", "k", "v", "g", "gv") else x for n, x in a.items()}
    second = {n: x[:, cut:] if n in ("q", "k", "v", "g", "gv") else x for n, x in a.items()}
    o1, s1 = oracle.recurrent(**cases.call_kwargs(case, first))
    o2, s2 = oracle.recurrent(**dict(cases.call_kwargs(case, second), initial_state=s1))
    np.testing.assert_allclose(np.concatenate([o1, o2], axis=1), o, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(s2, s, rtol=1e-13, atol=1e-13)


def test_named_variants():
    case = cases.Case("named", H=3, Hk=3, g="key")
    a = args_of(case)
    gamma = np.array([-(8 / 3 * (1 - 2 / 5)) * h for h in range(3)], np.float32)
    got = oracle.lightning_attn(a["q"], a["k"], a["v"], 2, 5)
    want = oracle.recurrent(a["q"], a["k"], a["v"], g_gamma=gamma)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(oracle.recurrent_gla(a["q"], a["k"], a["v"], g=a["g"])[0],
                                  oracle.recurrent(a["q"], a["k"], a["v"], gk=a["g"])[0])


def test_closed_forms():
    """No gates: causal linear attention as one masked matrix product; a constant
    scalar gate c: the mask becomes exp(c (t - s))."""
    case = cases.Case("closed", B=1, T=9, H=1, Hk=1, K=4, V=3)
    a = args_of(case)
    q, k, v = a["q"][0, :, 0], a["k"][0, :, 0], a["v"][0, :, 0]
    t = np.arange(case.T)
    scale = case.K ** -0.5
    o, _ = oracle.recurrent(a["q"], a["k"], a["v"])
    np.testing.assert_allclose(o[0, :, 0], scale * ((q @ k.T) * (t[:, None] >= t[None, :])) @ v,
                               rtol=1e-12)
    c = -0.3
    g = np.full((1, case.T, 1), c)
    o, _ = oracle.recurrent(a["q"], a["k"], a["v"], g=g)
    decay = np.exp(c * (t[:, None] - t[None, :])) * (t[:, None] >= t[None, :])
    np.testing.assert_allclose(o[0, :, 0], scale * ((q @ k.T) * decay) @ v, rtol=1e-12)


def test_bfloat16_input_is_computed_in_float64():
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="bf16 NumPy arrays need ml_dtypes")
    case = cases.Case("bf16", g="key")
    a = cases.inputs(case)
    low = {n: a[n].astype(ml_dtypes.bfloat16) for n in ("q", "k", "v", "g")}
    up = {n: x.astype(np.float64) for n, x in low.items()}
    o_low, s_low = oracle.recurrent(**low)
    o_up, s_up = oracle.recurrent(**up)
    assert o_low.dtype == np.float64
    np.testing.assert_array_equal(o_low, o_up)
    np.testing.assert_array_equal(s_low, s_up)
