"""The dispatch steps both frameworks share (bridge.dispatch, bridge.contract's offsets and
shape-only view) and the torch ops' direct path: each checked against an independent
result (the float64 oracle, the op itself, the contract's own errors)."""

import numpy as np
import pytest

from bridge import contract, dispatch
from bridge.contract import INPUTS
from parity import oracle

torch = pytest.importorskip("torch")


def _arrays(packed=False, seed=0):
    """q, k, v [B=1,T=5,H=2,K=3 / V=4] and a key gate, as float32 numpy (packed: no B)."""
    rng = np.random.default_rng(seed)
    lead = (5,) if packed else (1, 5)
    return dict(q=rng.standard_normal((*lead, 2, 3)).astype(np.float32),
                k=rng.standard_normal((*lead, 2, 3)).astype(np.float32),
                v=rng.standard_normal((*lead, 2, 4)).astype(np.float32),
                g=-rng.random((*lead, 2, 3)).astype(np.float32))


def test_batched_adds_the_batch_axis_to_packed_token_inputs_only():
    x = _arrays(packed=True)
    cu = np.array([0, 2, 5])
    h0 = np.ones((2, 2, 3, 4), np.float32)
    plan = contract.check(**x, initial_state=h0, cu_seqlens=cu)
    got = dispatch.batched(plan, dict(x, initial_state=h0), lambda a: a[None])
    assert tuple(got) == INPUTS
    assert got["q"].shape == (1, 5, 2, 3) and got["g"].shape == (1, 5, 2, 3)
    assert got["initial_state"] is h0 and got["gk"] is None and got["g_gamma"] is None
    assert dispatch.unbatched(plan, np.zeros((1, 5, 2, 4))).shape == (5, 2, 4)
    plan4 = contract.check(**_arrays())
    assert dispatch.batched(plan4, _arrays(), lambda a: a[None])["q"].shape == (1, 5, 2, 3)
    assert dispatch.unbatched(plan4, np.zeros((1, 5, 2, 4))).shape == (1, 5, 2, 4)


@pytest.mark.parametrize("platform,mode,gpu,want", [
    ("auto", "auto", False, ("torch", "torch")),
    ("auto", "fused_recurrent", False, ("triton", "fused_recurrent")),
    ("triton", "chunk", False, ("triton", "chunk")),
    ("triton", "auto", True, ("triton", "fused_recurrent")),  # T = 5: below the crossover
])
def test_prepare_resolves_platform_and_kernel(platform, mode, gpu, want):
    call = dispatch.prepare(_arrays(), softmax_scale=None, reverse=False, cu_seqlens=None,
                            platform=platform, mode=mode, platforms=("auto", "triton", "torch"),
                            fallback="torch", gpu=gpu)
    assert (call.platform, call.kernel) == want
    assert call.plan == contract.check(**_arrays())


def test_prepare_checks_before_routing():
    bad = dict(_arrays(), k=np.zeros((1, 5, 3, 3), np.float32))  # 3 kv heads for H = 2
    with pytest.raises(ValueError, match="^k:"):
        dispatch.prepare(bad, softmax_scale=None, reverse=False, cu_seqlens=None,
                         platform="nope", mode="auto", platforms=("auto",), fallback="torch",
                         gpu=False)


@pytest.mark.parametrize("cu,total,exc,msg", [
    (np.array([0, 2, 5]), 5, None, None),
    (np.array([1, 2, 5]), 5, ValueError, "start at 0"),
    (np.array([0, 3, 2, 5]), 5, ValueError, "non-decreasing"),
    (np.array([0, 2, 5]), 6, ValueError, "end at the token count 6"),
    (np.array([0, 2, 5]), None, None, None),  # total unknown: shape and type only
    (np.array([0.0, 5.0]), 5, TypeError, "integer dtype"),
    (np.array([5]), 5, ValueError, r"shape \[N \+ 1\]"),
    ([0, 5], 5, TypeError, "1-d integer array"),
])
def test_check_offsets(cu, total, exc, msg):
    if exc is None:
        assert contract.check_offsets(cu, total) == len(cu) - 1
    else:
        with pytest.raises(exc, match="^cu_seqlens: .*" + msg):
            contract.check_offsets(cu, total)


def test_shape_only_checks_shape_device_and_framework_not_values():
    x = {n: torch.from_numpy(a) for n, a in _arrays().items()}
    bad_values = torch.tensor([0, 7, 3])  # decreasing, wrong end: unread through ShapeOnly
    plan = contract.check(**x, cu_seqlens=contract.ShapeOnly(bad_values))
    assert plan.N == 2 and plan.varlen
    with pytest.raises(ValueError, match="^cu_seqlens: expected non-decreasing"):
        contract.check(**x, cu_seqlens=bad_values)
    with pytest.raises(TypeError, match="^cu_seqlens: expected an integer"):
        contract.check(**x, cu_seqlens=contract.ShapeOnly(bad_values.float()))
    import jax.numpy as jnp  # a jax array's view next to torch tensors: the framework check

    with pytest.raises(TypeError, match="^cu_seqlens: expected a torch array like q"):
        contract.check(**x, cu_seqlens=contract.ShapeOnly(jnp.asarray([0, 2, 5])))


def _torch_inputs(requires_grad=False):
    x = {n: torch.from_numpy(a).requires_grad_(requires_grad) for n, a in _arrays().items()}
    x["initial_state"] = torch.full((1, 2, 3, 4), 0.5).requires_grad_(requires_grad)
    return x


def _want(x):
    o, s = oracle.recurrent(**{n: t.detach().numpy() for n, t in x.items()})
    return o, s


@pytest.mark.parametrize("platform", ["torch", "triton"])
def test_direct_path_equals_the_oracle_and_skips_the_op_only_without_autograd(
        platform, monkeypatch):
    from torch_side import custom_ops, ops

    import types

    calls = []  # calls of the op itself, seen through the name ops.recurrent reads it by
    counted = types.SimpleNamespace(
        direct=custom_ops.direct, forward=custom_ops.forward,
        checks_offsets=custom_ops.checks_offsets,
        fwd=lambda *a, **k: calls.append(1) or custom_ops.fwd(*a, **k))
    monkeypatch.setattr(ops, "custom_ops", counted)
    x = _torch_inputs()
    want_o, want_s = _want(x)
    with torch.no_grad():
        o, s = ops.recurrent(**x, platform=platform, mode="chunk" if platform == "triton"
                             else "auto")
    assert calls == []  # eager, nothing to record: the op's body directly
    np.testing.assert_allclose(o.numpy(), want_o, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(s.numpy(), want_s, rtol=2e-5, atol=2e-5)

    xg = _torch_inputs(requires_grad=True)
    o, s = ops.recurrent(**xg, platform="torch")
    assert calls == [1]  # autograd needs the op (its registered backward)
    (o.sum() + s.sum()).backward()
    np_x = {n: t.detach().numpy() for n, t in x.items()}
    want = oracle.recurrent_grads(**np_x, do=np.ones(want_o.shape),
                                  dfinal_state=np.ones(want_s.shape))
    for n in ("q", "g", "initial_state"):
        np.testing.assert_allclose(xg[n].grad.numpy(), want[n], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(o.detach().numpy(), want_o, rtol=2e-5, atol=2e-5)

    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        o, _ = ops.recurrent(**x, platform="torch")
    assert calls == [1, 1] and o.dtype == torch.bfloat16  # the op's autocast rule ran


@pytest.mark.parametrize("platform", ["torch", "triton"])
@pytest.mark.parametrize("grad", [False, True], ids=["direct", "op"])
def test_offsets_values_are_read_once_per_call(platform, grad, monkeypatch):
    """Packed inputs with cu_seqlens, eager, on the direct path and through the op: the
    offsets' values are read once per call (by the contract, or by the op where it reads
    them), the result is the oracle's, and bad offsets are the contract's ValueError."""
    reads = []  # the values the contract's checks got to read

    def known_values(x, real=contract.known_values):
        values = real(x)
        if values is not None:
            reads.append(values)
        return values

    monkeypatch.setattr(contract, "known_values", known_values)
    from torch_side import ops

    x = {n: torch.from_numpy(a).requires_grad_(grad) for n, a in _arrays(packed=True).items()}
    cu = torch.tensor([0, 2, 5])
    mode = "chunk" if platform == "triton" else "auto"
    o, s = ops.recurrent(**x, cu_seqlens=cu, platform=platform, mode=mode)
    assert len(reads) == 1
    want_o, want_s = oracle.recurrent(**{n: t.detach().numpy() for n, t in x.items()},
                                      cu_seqlens=cu.numpy())
    np.testing.assert_allclose(o.detach().numpy(), want_o, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(s.detach().numpy(), want_s, rtol=2e-5, atol=2e-5)
    with pytest.raises(ValueError, match="^cu_seqlens: expected non-decreasing values"):
        ops.recurrent(**x, cu_seqlens=torch.tensor([0, 4, 3, 5]), platform=platform,
                      mode=mode)
