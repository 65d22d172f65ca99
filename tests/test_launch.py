"""Launches bound by kernel parameter name (bridge.launch) and the Plan's vocabulary and
tensor geometry (bridge.contract), each against something independent: NumPy closed
forms, the contract's own check of real arrays, the arrays' own sizes."""

import dataclasses

import numpy as np
import pytest

from bridge import contract, dispatch
from bridge.contract import INPUTS, Plan
from bridge.kernels import fused_recurrent
from bridge.launch import Launch, Out

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")


@triton.jit
def axpy(x, y, a, n, out, BLOCK: tl.constexpr):
    """out = a x + y - n over BLOCK elements."""
    o = tl.arange(0, BLOCK)
    tl.store(out + o, a * tl.load(x + o) + tl.load(y + o) - n)


@triton.jit
def axpy_reordered(y, n, x, a, out, BLOCK: tl.constexpr):
    """axpy with its tensor and scalar parameters in another order."""
    o = tl.arange(0, BLOCK)
    tl.store(out + o, a * tl.load(x + o) + tl.load(y + o) - n)


def _axpy(kernel, **over):
    bind = dict(inputs=dict(x="p", y="r"), scalars=dict(a=3.0, n=2),
                outputs=dict(out=Out("z", (16,))), constexprs=dict(BLOCK=16))
    bind.update(over)
    return Launch(kernel, (1,), **bind)


@pytest.mark.parametrize("kernel", [axpy, axpy_reordered])
def test_a_reordered_kernel_gets_the_same_arguments(kernel):
    """The same binding launches either parameter order correctly (NumPy closed form):
    each argument follows its parameter's name, not its position."""
    from bridge import torch_runner

    p = np.arange(16, dtype=np.float32)
    r = np.linspace(-1, 1, 16, dtype=np.float32)
    env = torch_runner.run([_axpy(kernel)], dict(q=torch.from_numpy(p), p=torch.from_numpy(p),
                                                 r=torch.from_numpy(r)))
    np.testing.assert_array_equal(env["z"].numpy(), 3.0 * p + r - 2)
    assert [name for name, _, _ in _axpy(kernel).arguments()] == [
        n for n in kernel.arg_names if n != "BLOCK"]


def test_positional_order_is_the_kernels_not_the_bindings():
    """A binding written in any order passes its arguments in the kernel's order."""
    launch = fused_recurrent.forward_launches(_plan())[0]
    shuffled = dataclasses.replace(launch, inputs=dict(reversed(list(launch.inputs.items()))),
                                   outputs=dict(reversed(list(launch.outputs.items()))))
    assert shuffled.arguments() == launch.arguments()
    runtime = [n for n in launch.kernel.arg_names if n not in launch.constexprs]
    assert [name for name, _, _ in launch.arguments()] == runtime


@pytest.mark.parametrize("over,fragment", [
    (dict(inputs=dict(x="p", y="r", w="s")), "no parameter named 'w'"),
    (dict(inputs=dict(x="p")), "parameter 'y' not bound"),
    (dict(scalars=dict(a=3.0, n=2, x=1.0)), "parameter 'x' bound twice (in and scalar)"),
    (dict(constexprs=dict()), "parameter 'BLOCK' not bound"),
    (dict(scalars=dict(n=2), outputs=dict(out=Out("z", (16,)), a=Out("m", (1,)))),
     "scalar parameter 'n' follows output 'a'"),
    (dict(inputs=(("x", "p"), ("y", "r"))), "in arguments must be a dict"),
])
def test_binding_errors_name_the_parameter(over, fragment):
    """Unknown, missing, doubly bound or misplaced parameters fail when the launch is
    built, naming the kernel and the parameter."""
    with pytest.raises(TypeError) as info:
        _axpy(axpy, **over)
    assert str(info.value).startswith("axpy: ") and fragment in str(info.value), str(info.value)


def test_a_renamed_kernel_parameter_is_an_error_not_a_shifted_argument():
    """A real launch list against a kernel whose parameter was renamed (h0 -> s0, the
    rest as in fused_recurrent_fwd_kernel): a clear error when the list is built."""
    real = fused_recurrent.fused_recurrent_fwd_kernel

    class Renamed:
        __name__ = real.__name__
        arg_names = tuple("s0" if n == "h0" else n for n in real.arg_names)

    launch = fused_recurrent.forward_launches(_plan())[0]
    with pytest.raises(TypeError, match="no parameter named 'h0'"):
        dataclasses.replace(launch, kernel=Renamed())

    class Moved:  # a constexpr moved ahead of the tensors
        __name__ = real.__name__
        arg_names = ("H", *(n for n in real.arg_names if n != "H"))

    with pytest.raises(TypeError, match="runtime parameter 'q' follows constexpr 'H'"):
        dataclasses.replace(launch, kernel=Moved())


# ---------------------------------------------------------------- the Plan

B, T, H, HK, K, V = 2, 5, 4, 2, 8, 6


def _arrays(seed=0, dtype=np.float32, g="key", g_gamma="head", packed=False, N=None):
    """Every input, [B,T,H,*] (packed: [T,H,*] with N sequences)."""
    rng = np.random.default_rng(seed)
    lead = (T,) if packed else (B, T)
    N = N or (B if not packed else 2)
    a = dict(q=(*lead, H, K), k=(*lead, HK, K), v=(*lead, HK, V),
             g=(*lead, H, K) if g == "key" else (*lead, H), gk=(*lead, H, K), gv=(*lead, H, V),
             g_gamma=(H,) if g_gamma == "head" else (N, H), initial_state=(N, H, K, V))
    return {n: rng.standard_normal(s).astype(dtype) for n, s in a.items()}


def _plan(**kw):
    return contract.check(**_arrays(**kw))


@pytest.mark.parametrize("g,g_gamma", [("key", "head"), ("head", "seq")])
def test_plan_shapes_and_bytes_are_the_arrays(g, g_gamma):
    """Plan.shape / nbytes of every input are those of the arrays it was checked from
    (float32 gates and states, as the launch plans assume), o and do [B,T,H,V]."""
    a = _arrays(g=g, g_gamma=g_gamma)
    plan = contract.check(**a)
    assert plan.inputs() == INPUTS
    for n, x in a.items():
        assert plan.shape(n) == x.shape and plan.nbytes(n) == x.nbytes, n
    assert plan.shape("cu_seqlens") == (B + 1,) and plan.tensor_dtype("cu_seqlens") == "int32"
    assert plan.outputs() == {"o": ((B, T, H, V), "float32"),
                              "final_state": ((B, H, K, V), "float32")}
    assert plan.gradients() == {n: (x.shape, "float32") for n, x in a.items()}
    with pytest.raises(ValueError, match="name: expected a tensor of the call"):
        plan.shape("nothing")


def test_plan_dtypes_follow_q_for_activations_and_gates():
    a = {n: x.astype(np.float16) for n, x in _arrays().items()}
    plan = contract.check(**a)
    assert [plan.tensor_dtype(n) for n in ("q", "v", "g", "gk", "do", "o")] == ["float16"] * 6
    assert [plan.tensor_dtype(n) for n in ("g_gamma", "initial_state", "final_state")] == [
        "float32"] * 3
    assert plan.nbytes("q") == a["q"].nbytes and plan.nbytes("g_gamma") == 4 * H


@pytest.mark.parametrize("given", [("q", "k", "v"), ("q", "k", "v", "g", "gv"), INPUTS])
@pytest.mark.parametrize("g,g_gamma", [("key", "head"), ("head", "seq")])
def test_of_batched_is_the_contracts_plan(given, g, g_gamma):
    """Plan.of_batched (shapes and ndim of batched arrays) gives the Plan the contract's
    full check gives, for batched and (through dispatch.batched) packed inputs."""
    for packed in (False, True):
        a = {n: x for n, x in _arrays(g=g, g_gamma=g_gamma, packed=packed).items() if n in given}
        cu = np.array([0, 2, T], np.int32) if packed else None
        want = contract.check(**a, cu_seqlens=cu, softmax_scale=0.5, reverse=True)
        batched = dispatch.batched(want, a, lambda x: x[None])
        got = Plan.of_batched(batched, cu, scale=0.5, reverse=True)
        assert got == dataclasses.replace(want, packed=False), (packed, given)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("g_gamma", ["head", "seq"])
def test_folded_is_the_plan_of_the_stacked_problems(packed, g_gamma):
    """Plan.folded(n) equals the contract's Plan of n problems stacked along the batch
    (packed: along the tokens, offsets shifted), g_gamma one row per sequence."""
    n = 3
    cu = np.array([0, 2, T], np.int32) if packed else None
    a = _arrays(g_gamma=g_gamma, packed=packed)
    plan = contract.check(**a, cu_seqlens=cu)
    N = plan.N
    gam = np.broadcast_to(a["g_gamma"], (N, H))
    stacked = {m: np.concatenate([x] * n) for m, x in a.items() if m != "g_gamma"}
    stacked["g_gamma"] = np.concatenate([gam] * n)
    cus = None if cu is None else np.concatenate(
        [cu[:-1] + i * T for i in range(n)] + [np.array([n * T], np.int32)])
    want = contract.check(**stacked, cu_seqlens=cus)
    assert plan.folded(n) == want
    shared = plan.folded(n, gamma_per_sequence=False)
    assert shared.g_gamma == plan.g_gamma and shared.N == want.N and shared.B == want.B


# ---------------------------------------------------------------- the key decay

@pytest.mark.parametrize("given", [(), ("g",), ("gk",), ("g_gamma",), ("g", "gk", "g_gamma"),
                                   ("gk", "g_gamma")])
def test_key_decay_is_the_oracles(given):
    """bridge.decay.key_decay on whole [B,T,H,K] arrays (numpy, torch, jax) equals the
    oracle's per-step log decay a_t, step by step; None with no key-side gate."""
    import jax.numpy as jnp

    from bridge.decay import key_decay
    from parity import oracle

    a = {n: x.astype(np.float64) for n, x in _arrays().items()}
    p = oracle._Problem(a["q"], a["k"], a["v"], a["g"] if "g" in given else None,
                        a["g_gamma"] if "g_gamma" in given else None,
                        a["gk"] if "gk" in given else None, None, None, None, False, None)
    for xp in (np.asarray, torch.from_numpy, jnp.asarray):
        got = key_decay(*(xp(a[n]) if n in given else None for n in ("g", "gk")),
                        xp(a["g_gamma"][:, None]) if "g_gamma" in given else None)
        if not given:
            assert got is None
            continue
        got = np.broadcast_to(np.asarray(got), (B, T, H, K))
        for b in range(B):
            for t in range(T):
                for h in range(H):
                    np.testing.assert_allclose(got[b, t, h], p.log_decays(b, b, t, h)[0],
                                               rtol=1e-6, atol=0)
