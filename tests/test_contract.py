"""The shared argument contract: every SPEC.md error case, in every framework."""

import numpy as np
import pytest

from bridge import contract, dispatch, variants

torch = pytest.importorskip("torch")
jnp = pytest.importorskip("jax.numpy")

B, T, H, HK, K, V = 2, 6, 4, 2, 8, 5

FRAMEWORKS = {
    "numpy": lambda a: a,
    "torch": torch.from_numpy,
    "jax": jnp.asarray,
}


def _args(xp, **over):
    """Valid arguments, with `over` replacing some; values are numpy shapes/dtypes."""
    shapes = dict(q=(B, T, H, K), k=(B, T, HK, K), v=(B, T, HK, V))
    arrays = {n: np.zeros(s, np.float32) for n, s in shapes.items()}
    arrays.update(over)
    return {n: (xp(a) if isinstance(a, np.ndarray) else a) for n, a in arrays.items()}


def _raises(exc, name, xp, **over):
    args = _args(xp, **over)
    with pytest.raises(exc) as info:
        contract.check(**args)
    assert str(info.value).startswith(name + ":"), str(info.value)
    return str(info.value)


def f32(*shape):
    return np.zeros(shape, np.float32)


@pytest.fixture(params=sorted(FRAMEWORKS))
def xp(request):
    return FRAMEWORKS[request.param]


def test_valid_plan(xp):
    plan = contract.check(**_args(xp, g=f32(B, T, H), gv=f32(B, T, H, V), g_gamma=f32(H),
                                  initial_state=f32(B, H, K, V)))
    assert (plan.B, plan.T, plan.H, plan.Hk, plan.K, plan.V, plan.N) == (B, T, H, HK, K, V, B)
    assert (plan.g, plan.gk, plan.gv, plan.g_gamma, plan.initial_state) == ("head", False, True,
                                                                             "head", True)
    assert plan.scale == pytest.approx(K ** -0.5) and plan.group == H // HK
    assert not plan.varlen and not plan.packed and plan.dtype == "float32"


def test_valid_packed_plan(xp):
    cu = np.array([0, 2, 2, 7], np.int32)
    plan = contract.check(**_args(xp, q=f32(7, H, K), k=f32(7, HK, K), v=f32(7, HK, V),
                                  g=f32(7, H, K), g_gamma=f32(3, H), initial_state=f32(3, H, K, V),
                                  cu_seqlens=cu, softmax_scale=0.25, reverse=True))
    assert (plan.B, plan.T, plan.N, plan.g, plan.g_gamma) == (1, 7, 3, "key", "seq")
    assert plan.varlen and plan.packed and plan.reverse and plan.scale == 0.25


@pytest.mark.parametrize("name,over", [
    ("q", dict(q=f32(B, T, H * K))),
    ("q", dict(q=f32(T, H, K), k=f32(T, HK, K), v=f32(T, HK, V))),  # packed without cu_seqlens
    ("k", dict(k=f32(B, T + 1, HK, K))),
    ("k", dict(k=f32(B, T, HK, K + 1))),
    ("k", dict(k=f32(B, T, 3, K), v=f32(B, T, 3, V))),  # H % Hk != 0
    ("v", dict(v=f32(B, T, HK + 1, V))),
    ("v", dict(v=f32(B, T, HK))),
    ("g", dict(g=f32(B, T, H, K + 1))),
    ("g", dict(g=f32(B, T, H + 1))),
    ("gk", dict(gk=f32(B, T, H))),
    ("gv", dict(gv=f32(B, T, H, K))),
    ("g_gamma", dict(g_gamma=f32(H + 1))),
    ("g_gamma", dict(g_gamma=f32(B + 1, H))),
    ("initial_state", dict(initial_state=f32(B + 1, H, K, V))),
    ("initial_state", dict(initial_state=f32(B, H, V, K))),
])
def test_shape_errors(xp, name, over):
    msg = _raises(ValueError, name, xp, **over)
    assert "expected" in msg and "got" in msg


@pytest.mark.parametrize("name", contract.INPUTS)
def test_non_floating_input(xp, name):
    shapes = dict(q=(B, T, H, K), k=(B, T, HK, K), v=(B, T, HK, V), g=(B, T, H, K),
                  gk=(B, T, H, K), gv=(B, T, H, V), g_gamma=(H,), initial_state=(B, H, K, V))
    msg = _raises(TypeError, name, xp, **{name: np.zeros(shapes[name], np.int32)})
    assert "int32" in msg


def test_not_an_array(xp):
    _raises(TypeError, "g", xp, g=[[0.0]])


def _packed(cu, total=7, **over):
    return dict(q=f32(1, total, H, K), k=f32(1, total, HK, K), v=f32(1, total, HK, V),
                cu_seqlens=np.asarray(cu), **over)


@pytest.mark.parametrize("cu,exc,fragment", [
    (np.array([[0, 7]]), ValueError, "[N + 1]"),
    (np.array([7]), ValueError, "[N + 1]"),
    (np.array([0.0, 7.0], np.float32), TypeError, "integer"),
    (np.array([1, 7]), ValueError, "start at 0"),
    (np.array([0, 5, 3, 7]), ValueError, "non-decreasing"),
    (np.array([0, 3, 6]), ValueError, "end at the token count 7"),
])
def test_cu_seqlens_errors(xp, cu, exc, fragment):
    assert fragment in _raises(exc, "cu_seqlens", xp, **_packed(cu))


def test_cu_seqlens_needs_batch_one(xp):
    over = dict(cu_seqlens=np.array([0, 3, T]))
    assert "B=1" in _raises(ValueError, "cu_seqlens", xp, **over)


def test_initial_state_count_with_cu_seqlens(xp):
    over = _packed([0, 3, 7], initial_state=f32(3, H, K, V))
    assert "N=2" in _raises(ValueError, "initial_state", xp, **over)


def test_cu_seqlens_values_unknown_under_jit():
    """A traced cu_seqlens is checked by shape and dtype only (its values are unknown)."""
    import jax

    def f(cu):
        plan = contract.check(jnp.zeros((7, H, K)), jnp.zeros((7, HK, K)), jnp.zeros((7, HK, V)),
                              cu_seqlens=cu)
        return jnp.zeros(plan.N)

    assert jax.jit(f)(jnp.array([0, 3, 7])).shape == (2,)
    assert jax.jit(f)(jnp.array([0, 9, 7])).shape == (2,)  # bad values: not knowable here
    with pytest.raises(TypeError, match="^cu_seqlens: expected an integer dtype"):
        jax.jit(f)(jnp.array([0.0, 7.0]))


@pytest.mark.parametrize("value,exc", [("0.5", TypeError), (True, TypeError),
                                       (float("nan"), ValueError), (float("inf"), ValueError)])
def test_bad_scale(xp, value, exc):
    _raises(exc, "softmax_scale", xp, softmax_scale=value)


def test_scale_accepts_numbers(xp):
    assert contract.check(**_args(xp, softmax_scale=np.float32(0.5))).scale == 0.5
    assert contract.check(**_args(xp, softmax_scale=2)).scale == 2.0


def test_bad_reverse(xp):
    _raises(TypeError, "reverse", xp, reverse="yes")


def test_devices_differ():
    args = _args(torch.from_numpy)
    args["v"] = args["v"].to("meta")
    with pytest.raises(ValueError, match=r"^v: expected every tensor on one device.*meta"):
        contract.check(**args)


def test_numpy_mixes_with_jax():
    """numpy arrays carry no device, so they may be handed to the JAX ops."""
    args = _args(jnp.asarray)
    args["g"] = f32(B, T, H)
    assert contract.check(**args).g == "head"


def test_a_remembered_plan_checks_whatever_changed():
    """check remembers the Plan of torch arguments that passed (decoding repeats them):
    the same arguments give the full check's Plan again, and the same shapes with another
    dtype, device, framework, scale or reverse are checked again, with the same errors."""
    args = _args(torch.from_numpy)
    plan = contract.check(**args, softmax_scale=0.5)
    assert contract.check(**args, softmax_scale=0.5) == plan
    assert plan == contract.check(**args, softmax_scale=0.5, memo=False)
    bad = [(dict(softmax_scale=float("nan")), ValueError, "softmax_scale"),
           (dict(softmax_scale=True), TypeError, "softmax_scale"),
           (dict(reverse=1), TypeError, "reverse"),
           (dict(k=args["k"].int()), TypeError, "k"),
           (dict(v=args["v"].to("meta")), ValueError, "v"),
           (dict(v=args["v"].numpy()), TypeError, "v")]
    for over, exc, name in bad:
        with pytest.raises(exc, match=f"^{name}: "):
            contract.check(**{**args, "softmax_scale": 0.5, **over})


@pytest.mark.parametrize("other", ["numpy", "jax"])
@pytest.mark.parametrize("first", ["torch", "other"])
def test_torch_mixes_with_nothing_else(first, other):
    """A torch tensor beside a numpy or jax array is a TypeError naming the odd
    argument (the torch ops would call tensor methods on it)."""
    xp = FRAMEWORKS[other]
    args = _args(torch.from_numpy if first == "torch" else xp)
    args["v"] = (xp if first == "torch" else torch.from_numpy)(f32(B, T, HK, V))
    with pytest.raises(TypeError, match=r"^v: expected a .* array like q.*got "):
        contract.check(**args)
    args = _args(torch.from_numpy)
    args["cu_seqlens"] = None
    assert contract.check(**args).B == B


@pytest.mark.parametrize("layer_idx,num_layers,exc,name", [
    (0, 0, ValueError, "num_layers"), (4, 4, ValueError, "layer_idx"),
    (-1, 4, ValueError, "layer_idx"), (1.0, 4, TypeError, "layer_idx"),
    (0, True, TypeError, "num_layers"),
])
def test_lightning_errors(layer_idx, num_layers, exc, name):
    with pytest.raises(exc, match=f"^{name}:"):
        variants.check_lightning(layer_idx, num_layers)


def test_lightning_g_gamma_is_the_spec_formula():
    for H, layer, layers in ((8, 3, 12), (7, 5, 24), (12, 0, 1)):
        got = variants.lightning_g_gamma(H, layer, layers)
        # the formula as torch reads it: a Python float times a float32 arange
        want = (-(8 / H * (1 - layer / layers)) * torch.arange(H, dtype=torch.float32)).numpy()
        assert got.dtype == np.float32 and np.array_equal(got, want)


@pytest.mark.parametrize("platform,mode,gpu,want", [
    ("auto", "auto", False, "xla"), ("auto", "chunk", False, "xla"),
    ("auto", "auto", True, "triton"), ("auto", "fused_recurrent", False, "triton"),
    ("triton", "fused_recurrent", False, "triton"), ("xla", "chunk", True, "xla"),
    ("pallas", "auto", False, "pallas"),
])
def test_route_resolves_auto(platform, mode, gpu, want):
    assert dispatch.route(platform, mode, ("auto", "triton", "xla", "pallas"), "xla",
                          gpu=gpu) == want


def test_route_picks_pallas_on_tpu():
    platforms = ("auto", "triton", "xla", "pallas")
    assert dispatch.route("auto", "auto", platforms, "xla", gpu=False, tpu=True) == "pallas"
    assert dispatch.route("auto", "chunk", platforms, "xla", gpu=False, tpu=False) == "xla"


@pytest.mark.parametrize("platform,mode,exc,start", [
    ("cuda", "auto", ValueError, "platform:"), ("auto", "fast", ValueError, "mode:"),
    ("xla", "fused_recurrent", ValueError, "mode:"),
    ("pallas", "fused_recurrent", ValueError, "mode:"),
])
def test_route_errors(platform, mode, exc, start):
    with pytest.raises(exc, match="^" + start):
        dispatch.route(platform, mode, ("auto", "triton", "xla", "pallas"), "xla", gpu=False)


def _plan(T, seqlens=None):
    if seqlens is None:
        q = np.zeros((1, T, 2, 8), np.float32)
        return contract.check(q, q, q)
    q = np.zeros((sum(seqlens), 2, 8), np.float32)
    return contract.check(q, q, q, cu_seqlens=np.cumsum((0,) + tuple(seqlens)))


def _crossover():
    """The smallest T the cost rule gives to the chunked kernels, by closed form:
    LAUNCH * 1 + T * FUSED_STEP > LAUNCH * 3 + ceil(T / 64) * CHUNK_STEP."""
    T = 1
    while (dispatch.LAUNCH_US + T * dispatch.FUSED_STEP_US
           <= 3 * dispatch.LAUNCH_US + -(-T // 64) * dispatch.CHUNK_STEP_US):
        T += 1
    return T


@pytest.mark.parametrize("mode,T,want", [
    ("auto", 1, "fused_recurrent"), ("auto", 64, "fused_recurrent"),
    ("auto", 4096, "chunk"), ("chunk", 1, "chunk"), ("fused_recurrent", 4096, "fused_recurrent"),
])
def test_kernel_mode_by_cost(mode, T, want):
    assert dispatch.kernel_mode(mode, _plan(T)) == want


def test_kernel_mode_crossover_follows_the_cost_rule():
    T = _crossover()
    assert 64 < T < 200  # decoding and short prompts stay fused
    assert dispatch.kernel_mode("auto", _plan(T - 1)) == "fused_recurrent"
    assert dispatch.kernel_mode("auto", _plan(T)) == "chunk"


def test_kernel_mode_varlen_uses_the_mean_length():
    """Many short packed sequences (decoding a batch) stay fused although the
    total is long; a few long ones go to the chunked kernels."""
    assert dispatch.kernel_mode("auto", _plan(0, seqlens=[4] * 256)) == "fused_recurrent"
    assert dispatch.kernel_mode("auto", _plan(0, seqlens=[1500, 2596])) == "chunk"


# ---------------------------------------------------------------- offsets on a GPU: no host sync
def test_offsets_on_cuda_are_checked_without_a_host_read():
    """The CUDA branch never reads the offsets on the host (the stand-in raises HostRead on
    .cpu(), .item(), .numpy(), .tolist(), __array__, bool(), int(), .to()): the shared
    steps of every call pass for valid offsets, packed and batched."""
    from parity.gpu.standins import posing_on_cuda

    for lead in ((7,), (1, 7)):
        x = {n: posing_on_cuda(torch.zeros(*lead, *s)) for n, s in
             (("q", (H, K)), ("k", (HK, K)), ("v", (HK, V)), ("g", (H, K)))}
        plan = dispatch.prepare(x, softmax_scale=None, reverse=False, platform="triton",
                                mode="auto", platforms=("auto", "triton", "torch"),
                                fallback="torch", gpu=True,
                                cu_seqlens=posing_on_cuda(torch.tensor([0, 3, 7]))).plan
        assert (plan.N, plan.T, plan.varlen, plan.packed) == (2, 7, True, len(lead) == 1)


@pytest.mark.parametrize("cu,fragment", [
    ([1, 3, 7], "cu_seqlens: expected to start at 0"),
    ([0, 5, 3, 7], "cu_seqlens: expected non-decreasing values"),
    ([0, 3, 6], "cu_seqlens: expected to end at the token count 7"),
])
def test_bad_offsets_on_cuda_fail_on_the_device(cu, fragment):
    """Bad values are caught by device-side asserts (on the stand-in's CPU storage they
    raise at once, with the host check's wording), still without a host read."""
    from parity.gpu.standins import posing_on_cuda

    x = {n: posing_on_cuda(torch.zeros(7, *s)) for n, s in (("q", (H, K)), ("k", (HK, K)),
                                                              ("v", (HK, V)))}
    with pytest.raises(RuntimeError, match="^" + fragment):
        contract.check(**x, cu_seqlens=posing_on_cuda(torch.tensor(cu)))


def test_host_checks_opt_in_reads_cuda_offsets_on_the_host():
    from parity.gpu.standins import HostRead, posing_on_cuda

    cu = posing_on_cuda(torch.tensor([0, 3, 7]))
    with contract.host_checks(), pytest.raises(HostRead):
        contract.check_offsets(cu, 7)
    assert contract.check_offsets(cu, 7) == 2  # the switch is off again
    env = dict(__import__("os").environ, GLA_BRIDGE_HOST_CHECKS="1")
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", "from bridge import contract; "
                          "print(contract._HOST_CHECKS[0])"], env=env, capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "True"


def test_concrete_jax_offsets_on_a_gpu_are_not_read():
    """A concrete JAX array on a GPU goes unchecked by value, as a traced one does (JAX has
    no asynchronous assert); host_checks reads it."""
    from parity.gpu.standins import JaxOnGpu

    bad = JaxOnGpu(np.array([0, 9, 7]))
    assert contract.check(f32(7, H, K), f32(7, HK, K), f32(7, HK, V), cu_seqlens=bad).N == 2
    assert contract.known_values(bad) is None and bad.reads == []
    with contract.host_checks():
        contract.check_offsets(bad, 7)
    assert bad.reads == ["__array__"]
