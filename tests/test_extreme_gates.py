"""Gates at the extremes (SPEC.md, "Edge inputs": resets), on every CPU backend of both
frameworks (the Triton ones in the interpreter, Pallas in interpret mode), both
directions: one step's log decay at -1e4 .. -3e38 or exactly -inf (log 0, a full reset),
a constant decay g_gamma of -inf, and every step's decay far below -80. Each must give
the float64 oracle's values and gradients within the float32 tolerance: the oracle's
exp(-inf) = 0 makes the step forget the state, and the gradient of such a gate is 0."""

import numpy as np
import pytest

from parity import backends, cases
from parity.compare import GATE_GRADS, assert_close, rel_err, tolerance

pytest.importorskip("torch")
pytest.importorskip("jax")

BACKENDS = [b for b in backends.all_backends()[1:] if b.unavailable() is None]
FAST = [b for b in BACKENDS if b.name in ("torch-torch", "jax-xla")]
RESETS = (-1e4, -1e6, -1e10, -3e38, -np.inf)
ids = lambda b: b.name  # noqa: E731


def errors(backend, case, arrays, gate_floor=0.0):
    """({quantity: relative error} of the backend against the oracle on `arrays`, the
    backend's results); the gate gradients against an RMS floor of gate_floor (they can
    lie below float32's range where the oracle's do not)."""
    want = backends.Oracle().run(case, arrays, "float32")
    got = backend.run(case, arrays, "float32")
    assert set(got) == set(want), (sorted(got), sorted(want))
    return {n: rel_err(got[n], want[n], gate_floor if n in GATE_GRADS else 0.0)
            for n in want}, got


# The issue-43 table: one step of a (1, 70, 2, 16, 16) GLA call at each reset value.
TABLE = cases.Case("table", T=70, H=2, Hk=2, K=16, V=16, g="key", initial_state=True)


@pytest.mark.parametrize("reverse", [False, True], ids=["fwd", "rev"])
@pytest.mark.parametrize("gate", RESETS, ids=str)
@pytest.mark.parametrize("backend", FAST, ids=ids)
def test_one_reset_step(backend, gate, reverse):
    case = TABLE.with_(reverse=reverse)
    arrays = backends.prepared(case, "float32")
    arrays["g"][0, 20] = gate
    errs, got = errors(backend, case, arrays)
    assert_close(errs)
    if gate == -np.inf:  # the gate's own gradient is 0, up to float32 rounding of the
        # O(1) terms the chunked paths cancel to get it
        dg = np.asarray(got["dg"], np.float64)
        assert np.max(np.abs(dg[0, 20])) <= tolerance("float32") * np.max(np.abs(dg))


def _key_resets(case):
    """Every reset value at its own step, head and key dims of g (and a whole step of
    -inf over every head)."""
    arrays = backends.prepared(case, "float32")
    for i, gate in enumerate(RESETS):
        arrays["g"][0, 4 + 6 * i, i % case.H, (i % 2) * case.K // 2:] = gate
    arrays["g"][0, case.T - 6] = -np.inf
    return arrays


def _all_gate_resets(case):
    """Resets in every gate input of a packed call: a head gate of -3e38, gk of -1e10,
    gv of -inf at one token each, and a g_gamma of -inf (every step of sequence 2,
    head 1, a reset)."""
    arrays = backends.prepared(case, "float32")
    arrays["g"][0, 3, 0] = -3e38
    arrays["gk"][0, 12, 1, :3] = -1e10
    arrays["gv"][0, 8, 0, :5] = -np.inf
    arrays["gv"][0, 30, 1] = -np.inf
    arrays["g_gamma"][2, 1] = -np.inf
    return arrays


CASES = {
    "key-resets": (cases.Case("key-resets", T=40, H=2, Hk=2, K=8, V=8, g="key",
                              initial_state=True), _key_resets),
    "all-gates-varlen": (cases.Case("all-gates-varlen", seqlens=(23, 0, 17), H=2, Hk=2,
                                    K=8, V=8, g="head", gk=True, gv=True, g_gamma="seq",
                                    initial_state=True), _all_gate_resets),
}


@pytest.mark.parametrize("reverse", [False, True], ids=["fwd", "rev"])
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("backend", BACKENDS, ids=ids)
def test_resets_every_backend(backend, name, reverse):
    case, make = CASES[name]
    case = case.with_(reverse=reverse)
    assert_close(errors(backend, case, make(case))[0])


@pytest.mark.parametrize("reverse", [False, True], ids=["fwd", "rev"])
@pytest.mark.parametrize("backend", FAST, ids=ids)
def test_resets_decoding(backend, reverse):
    """Three tokens a row: the step-by-step decoding paths of torch-native and XLA."""
    case = cases.Case("decode", B=2, T=3, H=2, Hk=1, K=8, V=8, g="key", initial_state=True,
                      reverse=reverse)
    arrays = backends.prepared(case, "float32")
    arrays["g"][0, :, :, :4] = -np.inf
    arrays["g"][1, 1] = -1e10
    assert_close(errors(backend, case, arrays)[0])


# Every step's log decay between -1000 and -100: each step forgets all before it
# (o_t = scale q_t k_t^T v_t plus e^-100-size terms), and the gate gradients lie
# below float32's range: they are measured against a floor of 1e-3 (RMS).
FAR = cases.Case("far-below", seqlens=(37, 9), H=2, Hk=2, K=8, V=8, g="key", gv=True,
                 g_gamma="head", initial_state=True, gate_scale=1000.0, gate_range=(0.1, 1.0))


@pytest.mark.parametrize("reverse", [False, True], ids=["fwd", "rev"])
@pytest.mark.parametrize("backend", BACKENDS, ids=ids)
def test_decays_far_below(backend, reverse):
    case = FAR.with_(reverse=reverse)
    errs = errors(backend, case, backends.prepared(case, "float32"), gate_floor=1e-3)[0]
    assert_close(errs)


def test_oracle_reset_closed_form():
    """The oracle itself at g_gamma = -inf (every step a reset), against the closed form:
    o_t = scale (q_t . k_t) v_t, final_state = k_T^T v_T, the initial state and the gate
    without gradient."""
    from parity import oracle

    case = cases.Case("all-resets", T=5, H=2, Hk=2, K=3, V=4, g_gamma="head",
                      initial_state=True)
    x = cases.inputs(case)
    x["g_gamma"][:] = -np.inf
    kw = dict(g_gamma=x["g_gamma"], initial_state=x["initial_state"])
    o, fin = oracle.recurrent(x["q"], x["k"], x["v"], **kw)
    qk = np.einsum("bthk,bthk->bth", x["q"].astype(np.float64), x["k"]) * case.K ** -0.5
    np.testing.assert_allclose(o, qk[..., None] * x["v"], rtol=1e-12, atol=1e-12)
    k, v = (x[n][:, -1].astype(np.float64) for n in ("k", "v"))
    np.testing.assert_allclose(fin, np.einsum("bhk,bhv->bhkv", k, v), rtol=1e-12)
    grads = oracle.recurrent_grads(x["q"], x["k"], x["v"], **kw, do=x["do"],
                                   dfinal_state=x["dfinal_state"])
    assert np.all(grads["g_gamma"] == 0) and np.all(grads["initial_state"] == 0)
