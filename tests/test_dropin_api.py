"""Drop-in for ejkernel and EasyDeL beyond their printed examples (tests/test_dropin.py):
ejkernel's keyword names (query/key/value) and platform names on every public function,
EasyDeL's call conventions, and the variants as functions: one signature on both sides,
docstrings whose examples run."""

import doctest
import importlib.util
import inspect
import types

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jax_side
import torch_side
from bridge import dispatch
from parity import oracle
from parity.compare import TOLERANCE
from test_dropin import ORACLE, assert_matches


# ---- ejkernel's keyword names and platform names, on every public function

FNS = ("recurrent", "recurrent_gla", "lightning_attn", "gla_attention")


def _small(fw):
    r = np.random.default_rng(3)
    q, k, v = (r.standard_normal((1, 12, 4, 8), np.float32) for _ in range(3))
    to = torch.from_numpy if fw is torch_side else jnp.asarray
    return to(q), to(k), to(v)


@pytest.mark.parametrize("fw", [jax_side, torch_side], ids=["jax", "torch"])
@pytest.mark.parametrize("fn", FNS)
def test_ejkernel_keyword_names(fw, fn):
    """query/key/value name q/k/v: the same numbers (the oracle's) by either name or
    mixed; both names for one argument, or neither, is a TypeError naming it."""
    f = getattr(fw, fn)
    extra = dict(layer_idx=1, num_layers=4) if fn == "lightning_attn" else {}
    q, k, v = _small(fw)
    first = lambda out: np.asarray(out[0] if isinstance(out, tuple) else out)
    by_position = first(f(q, k, v, **extra))
    want = ORACLE.lightning_attn(q, k, v, 1, 4)[0] if extra else oracle.recurrent(q, k, v)[0]
    assert_matches(by_position, want)
    for call in (lambda: f(query=q, key=k, value=v, **extra),
                 lambda: f(q, key=k, value=v, **extra),
                 lambda: f(q=q, k=k, v=v, **extra),
                 lambda: f(q, k, value=v, **extra)):
        np.testing.assert_array_equal(first(call()), by_position)
    with pytest.raises(TypeError, match=r"^q: given twice, as q= and as query="):
        f(q, k, v, query=q, **extra)
    with pytest.raises(TypeError, match=r"^k: given twice"):
        f(q, k=k, key=k, value=v, **extra)
    with pytest.raises(TypeError, match=r"^v: missing"):
        f(q, k, **extra)
    with pytest.raises(TypeError, match=r"^q: missing"):
        f(key=k, value=v, **extra)


@pytest.mark.parametrize("fw", [jax_side, torch_side], ids=["jax", "torch"])
def test_ejkernel_tuning_arguments_are_accepted(fw):
    """ejkernel's block_k/block_v/num_warps/num_stages (by keyword or in its positional
    order) and gla_attention's cfg are accepted and change nothing: our launch plans
    pick their own tiles (cfg.platform is honoured)."""
    q, k, v = _small(fw)
    tuning = dict(block_k=64, block_v=64, num_warps=4, num_stages=1)
    for fn, extra in (("recurrent", {}), ("recurrent_gla", {}),
                      ("lightning_attn", dict(layer_idx=0, num_layers=2))):
        f = getattr(fw, fn)
        np.testing.assert_array_equal(np.asarray(f(q, k, v, **extra, **tuning)[0]),
                                      np.asarray(f(q, k, v, **extra)[0]))
    positional = fw.recurrent(q, k, v, None, None, None, None, None, None, False, None,
                              64, 64, 4, 1)  # ejkernel's positional order
    np.testing.assert_array_equal(np.asarray(positional[0]), np.asarray(fw.recurrent(q, k, v)[0]))
    cfg = types.SimpleNamespace(platform="auto", block_q=64, block_k=64, num_warps=4)
    np.testing.assert_array_equal(np.asarray(fw.gla_attention(q, k, v, cfg=cfg)),
                                  np.asarray(fw.gla_attention(q, k, v)))
    with pytest.raises(ValueError, match="^platform:.*tilelang"):  # cfg.platform is read
        fw.gla_attention(q, k, v, cfg=types.SimpleNamespace(platform="tilelang"))


@pytest.mark.parametrize("platforms,fallback", [(("auto", "triton", "torch"), "torch"),
                                                (("auto", "triton", "xla", "pallas"), "xla")])
def test_cuda_means_the_triton_kernels_on_a_gpu(platforms, fallback):
    assert dispatch.route("cuda", "auto", platforms, fallback, gpu=True) == "triton"
    with pytest.raises(ValueError, match="^platform: 'cuda' means the Triton kernels"):
        dispatch.route("cuda", "auto", platforms, fallback, gpu=False)


@pytest.mark.parametrize("fw,platform,hint", [
    (torch_side, "xla", "in PyTorch it is 'torch'"), (torch_side, "pallas", "jax_side"),
    (torch_side, "tilelang", "Triton"), (torch_side, "cute", "Triton"),
    (jax_side, "torch", "in JAX it is 'xla'"), (jax_side, "tilelang", "Triton"),
    (jax_side, "cute", "Triton"), (torch_side, "cuda", "q is not a CUDA tensor"),
    (jax_side, "cuda", "not a GPU"),
], ids=lambda x: getattr(x, "__name__", x))
def test_ejkernel_platform_names_refused_with_what_to_use(fw, platform, hint):
    """On this CPU machine: ejkernel's platform names that mean nothing here are a
    ValueError naming `platform` and what to use instead."""
    q, k, v = _small(fw)
    for fn in FNS:
        extra = dict(layer_idx=0, num_layers=2) if fn == "lightning_attn" else {}
        with pytest.raises(ValueError, match="^platform:") as info:
            getattr(fw, fn)(q, k, v, platform=platform, **extra)
        assert hint in str(info.value)


# ---- EasyDeL's call conventions beyond its examples

@pytest.mark.parametrize("fw", [jax_side, torch_side], ids=["jax", "torch"])
def test_easydel_conventions(fw):
    """scale (-1.0: D ** -0.5; another value as given), dtype (inputs cast to it, both
    outputs in it), output_final_state, chunk_size (no effect) and their errors."""
    r = np.random.default_rng(5)
    q, k = (r.standard_normal((2, 20, 2, 8), np.float32) for _ in range(2))
    v = r.standard_normal((2, 20, 2, 4), np.float32)
    gk = np.log(1 / (1 + np.exp(-r.standard_normal((2, 20, 2, 8), np.float32) - 2)))
    h0 = r.standard_normal((2, 2, 8, 4), np.float32)
    torch_fw = fw is torch_side
    to = torch.from_numpy if torch_fw else jnp.asarray
    bf16 = torch.bfloat16 if torch_fw else jnp.bfloat16
    f = fw.easydel.recurrent_gla
    o, s = f(*map(to, (q, k, v, gk)), 0.5, to(h0), output_final_state=True)
    want_o, want_s = oracle.recurrent(q, k, v, g=gk, softmax_scale=0.5, initial_state=h0)
    assert_matches(o, want_o)
    assert_matches(s, want_s)
    o2, s2 = f(*map(to, (q, k, v, gk)), scale=0.5, initial_state=to(h0), chunk_size=7)
    assert s2 is None
    np.testing.assert_array_equal(np.asarray(o2), np.asarray(o))
    o, s = f(*map(to, (q, k, v, gk)), initial_state=to(h0), dtype=bf16, output_final_state=True)
    assert o.dtype == bf16 and s.dtype == bf16
    bq, bk, bv, bg = (np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64) for x in (q, k, v, gk))
    bh0 = np.asarray(jnp.asarray(h0, jnp.bfloat16), np.float64)
    want_o, want_s = oracle.recurrent(bq, bk, bv, g=bg, initial_state=bh0)  # inputs in bf16
    to_np = lambda x: x.float().numpy() if torch_fw else np.asarray(x, np.float32)
    assert_matches(to_np(o), want_o, tol=TOLERANCE["bfloat16"])
    assert_matches(to_np(s), want_s, tol=TOLERANCE["bfloat16"])
    bad = ((dict(chunk_size=-1), ValueError, "chunk_size"),
           (dict(chunk_size=2.0), TypeError, "chunk_size"),
           (dict(output_final_state=1), TypeError, "output_final_state"),
           (dict(dtype=torch.int32 if torch_fw else jnp.int32), TypeError, "dtype"))
    for kwargs, exc, name in bad:
        with pytest.raises(exc, match=f"^{name}:"):
            f(*map(to, (q, k, v, gk)), **kwargs)


# ---- the variants as functions of their own, the same on both sides

TWINS = {name: (getattr(torch_side, name), getattr(jax_side, name)) for name in FNS[1:]}
TWINS["easydel"] = (torch_side.easydel.recurrent_gla, jax_side.easydel.recurrent_gla)
SHAPES_NAMED = {"easydel": ("[B,S,H,D]", "o [B,S,H,V]", "final_state [B,H,D,V]")}


@pytest.mark.parametrize("name", list(TWINS))
def test_variant_is_a_function_with_its_twins_signature(name):
    """Each PyTorch variant is a function defined under its own name, with its JAX twin's
    parameters (names, order, kinds, defaults; EasyDeL's `dtype` defaults to each
    framework's float32), and a docstring naming the shapes it takes and returns."""
    ours_torch, ours_jax = TWINS[name]
    want_name = "recurrent_gla" if name == "easydel" else name
    for fn in (ours_torch, ours_jax):
        assert fn.__qualname__ == want_name, fn.__qualname__  # not a factory's closure
        for shape in SHAPES_NAMED.get(name, ("q [B,T,H,K]", "v [B,T,Hk,V]", "o [B,T,H,V]",
                                             "[N,H,K,V]")):
            assert shape in fn.__doc__, (fn.__module__, shape)
    torch_params = inspect.signature(ours_torch).parameters
    jax_params = inspect.signature(ours_jax).parameters
    if name == "easydel":
        assert torch_params["dtype"].default is torch.float32
        assert jnp.dtype(jax_params["dtype"].default) == jnp.float32
        torch_params, jax_params = ({n: p for n, p in ps.items() if n != "dtype"}
                                    for ps in (torch_params, jax_params))
        assert list(inspect.signature(ours_torch).parameters).index("dtype") == \
            list(inspect.signature(ours_jax).parameters).index("dtype")
    assert list(torch_params.values()) == list(jax_params.values())


@pytest.mark.parametrize("module", ["torch_side.variants", "jax_side.variants",
                                    "torch_side.easydel", "jax_side.easydel"])
def test_variant_docstring_examples_run(module):
    """Every example in the variants' docstrings runs and prints what it says."""
    mod = importlib.import_module(module)
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0, result
