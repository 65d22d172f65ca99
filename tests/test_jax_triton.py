"""The same Triton kernels launched from JAX (a host callback into the Triton
interpreter on CPU, jax-triton on CUDA), against the oracle and against the
PyTorch launch, under jit, grad, vmap and checkpoint."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import jax.numpy as jnp  # noqa: E402

import jax_side  # noqa: E402
import torch_side  # noqa: E402
from parity import backends, cases, oracle  # noqa: E402
from parity.compare import errors, rel_err, tolerance  # noqa: E402

JAX = backends.JaxBackend("triton", "fused_recurrent")
TORCH = backends.TorchBackend("triton", "fused_recurrent")
ORACLE = backends.Oracle()
KW = dict(platform="triton", mode="fused_recurrent")

CHOSEN = [c for c in cases.FEATURES
          if c.name in ("g-head", "gamma-seq", "reverse", "varlen", "gqa", "everything",
                        "strong-gates")]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", CHOSEN, ids=lambda c: c.name)
def test_matches_oracle_and_torch_launch(case, dtype):
    arrays = backends.prepared(case, dtype)
    got = JAX.run(case, arrays, dtype)
    want = ORACLE.run(case, arrays, dtype)
    errs = errors(got, want, case.gate_grad_floor)
    assert max(errs.values()) <= tolerance(dtype), errs
    # one kernel, two launchers: the same inputs give the same numbers
    same = errors(got, TORCH.run(case, arrays, dtype))
    assert max(same.values()) == 0.0, same


def test_traced_cu_seqlens_and_g_gamma_one_compile():
    """cu_seqlens and g_gamma are primal arguments: traced under jit, so one
    compile serves every packing of the same total length and N."""
    case = cases.Case("packing", H=2, Hk=1, seqlens=(5, 7), g="key", g_gamma="seq",
                      packed=True)
    a = cases.inputs(case, seed=1)
    traces = []

    def f(q, k, v, g, g_gamma, cu):
        traces.append(1)
        return jax_side.recurrent(q, k, v, g=g, g_gamma=g_gamma, cu_seqlens=cu, **KW)

    f = jax.jit(f)
    for cu in (np.array([0, 5, 12], np.int32), np.array([0, 9, 12], np.int32)):
        o, s = f(a["q"], a["k"], a["v"], a["g"], a["g_gamma"], cu)
        want_o, want_s = oracle.recurrent(a["q"], a["k"], a["v"], g=a["g"],
                                          g_gamma=a["g_gamma"], cu_seqlens=cu)
        assert rel_err(o, want_o) < 2e-5 and rel_err(s, want_s) < 2e-5
    assert len(traces) == 1


def test_grad_through_traced_g_gamma():
    case = cases.Case("gamma", B=2, H=2, Hk=2, g_gamma="head", initial_state=True)
    a = cases.inputs(case, seed=2)

    def loss(g_gamma):
        o, s = jax_side.recurrent(a["q"], a["k"], a["v"], g_gamma=g_gamma,
                                  initial_state=a["initial_state"], **KW)
        return (o * a["do"]).sum() + (s * a["dfinal_state"]).sum()

    got = jax.jit(jax.grad(loss))(jnp.asarray(a["g_gamma"]))
    want = oracle.recurrent_grads(a["q"], a["k"], a["v"], g_gamma=a["g_gamma"],
                                  initial_state=a["initial_state"], do=a["do"],
                                  dfinal_state=a["dfinal_state"])["g_gamma"]
    assert rel_err(got, want) < 2e-5


def test_vmap_over_a_leading_axis():
    case = cases.Case("vmap", H=1, Hk=1, g="head", initial_state=True)
    batch = [cases.inputs(case, seed=s) for s in range(3)]
    stack = {n: np.stack([b[n] for b in batch]) for n in ("q", "k", "v", "g", "initial_state")}

    def f(q, k, v, g, h0):
        return jax_side.recurrent(q, k, v, g=g, initial_state=h0, **KW)

    o, s = jax.jit(jax.vmap(f))(*(stack[n] for n in ("q", "k", "v", "g", "initial_state")))
    for i, b in enumerate(batch):
        oi, si = f(*(b[n] for n in ("q", "k", "v", "g", "initial_state")))
        assert np.array_equal(o[i], oi) and np.array_equal(s[i], si)
    # and the gradient of a vmapped call equals the per-example gradients
    names = ("q", "k", "v", "g", "initial_state")
    per_example = jax.grad(lambda q, k, v, g, h0: f(q, k, v, g, h0)[0].sum())
    dq_v = jax.jit(jax.vmap(per_example))(*(stack[n] for n in names))
    for i, b in enumerate(batch):
        assert np.array_equal(dq_v[i], per_example(*(b[n] for n in names)))


def test_checkpoint():
    case = cases.Case("remat", H=1, Hk=1, g="key")
    a = cases.inputs(case, seed=4)

    def loss(q):
        o, _ = jax_side.recurrent(q, a["k"], a["v"], g=a["g"], **KW)
        return (o * a["do"]).sum()

    plain = jax.grad(loss)(a["q"])
    remat = jax.jit(jax.grad(jax.checkpoint(loss)))(a["q"])
    assert np.array_equal(plain, remat)


def test_same_errors_as_torch():
    """Both frameworks share the contract, so bad input fails the same way."""
    q = np.zeros((1, 4, 3, 8), np.float32)
    k = np.zeros((1, 4, 2, 8), np.float32)
    v = np.zeros((1, 4, 2, 8), np.float32)
    messages = []
    for fw in (jax_side, torch_side):
        conv = (lambda x: x) if fw is jax_side else torch.from_numpy
        with pytest.raises(ValueError) as info:
            fw.recurrent(conv(q), conv(k), conv(v), **KW)
        messages.append(str(info.value))
    assert messages[0] == messages[1] and messages[0].startswith("k:")
    with pytest.raises(NotImplementedError, match="pallas"):
        jax_side.recurrent(q, k[:, :, :1], v[:, :, :1], platform="pallas")
    with pytest.raises(ValueError, match="^platform:"):
        jax_side.recurrent(q, k[:, :, :1], v[:, :, :1], platform="cuda")
