"""Drop-in for ejkernel and EasyDeL: every example printed in their documentation for
`recurrent`, `recurrent_gla`, `lightning_attn`, `gla_attention` (ejkernel 0.0.80.3) and
EasyDeL's `recurrent_gla`, run as written against ours (JAX, and PyTorch through a
conversion), checked against the float64 oracle and, where ejkernel is installed (the
bench extra), against ejkernel's own functions. Where ejkernel's own example fails, the
test asserts that it does and that ours computes the oracle's numbers. Then ejkernel's
keyword names (query/key/value), its platform names, and EasyDeL's call conventions;
last, the variants as functions: one signature on both sides, docstrings whose examples run."""

import doctest
import functools
import importlib.util
import inspect
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jax_side
import torch_side
from bridge import dispatch
from parity import oracle
from parity.compare import TOLERANCE

HAVE_EJKERNEL = importlib.util.find_spec("ejkernel") is not None
NO_EJKERNEL = ("ejkernel is not installed (it comes with the bench extra): ejkernel's own "
               "numbers are not compared; test_example_matches_oracle still checks ours")

EXAMPLES = {}  # name -> (where it is printed, the example: ops namespace -> outputs)


def example(where):
    def register(fn):
        EXAMPLES[fn.__name__] = (where, fn)
        return fn
    return register


# ---- ejkernel: ejkernel/kernels/_xla/recurrent/_interface.py, recurrent's docstring

@example("ejkernel kernels/_xla/recurrent/_interface.py: recurrent, batched")
def recurrent_batched(ops):
    query = jnp.ones((2, 100, 8, 64))
    key = jnp.ones((2, 100, 8, 64))
    value = jnp.ones((2, 100, 8, 64))
    output, final_state = ops.recurrent(query, key, value)
    assert output.shape == (2, 100, 8, 64)
    assert final_state.shape == (2, 8, 64, 64)
    return output, final_state


@example("ejkernel kernels/_xla/recurrent/_interface.py: recurrent, varlen packed-stream")
def recurrent_varlen(ops):
    query = jnp.ones((1, 150, 8, 64))
    cu_seqlens = jnp.array([0, 50, 100, 150])
    output, final_state = ops.recurrent(query, query, query,
                                        cu_seqlens=cu_seqlens)
    assert final_state.shape == (3, 8, 64, 64)
    return output, final_state


@example("ejkernel kernels/_triton/recurrent/_interface.py: module docstring")
def recurrent_triton_doc(ops):
    batch, seq_len, num_heads, head_dim = 2, 1024, 8, 64
    q = jnp.ones((batch, seq_len, num_heads, head_dim))
    k = jnp.ones((batch, seq_len, num_heads, head_dim))
    v = jnp.ones((batch, seq_len, num_heads, head_dim))

    output, final_state = ops.recurrent(q, k, v)
    return output, final_state


# ---- ejkernel: kernels/_xla/gla/_interface.py (and _xla_impl_fwd.py), recurrent_gla.
# Its gates are +1 (a growing state): the outputs overflow float32 after ~88 steps,
# as the mathematics does; ours and the oracle overflow at the same entries.

@example("ejkernel kernels/_xla/gla/_interface.py: recurrent_gla, batched")
def recurrent_gla_batched(ops):
    q = jnp.ones((2, 100, 8, 64))
    k = jnp.ones((2, 100, 8, 64))
    v = jnp.ones((2, 100, 8, 64))
    g = jnp.ones((2, 100, 8, 64))
    output, final_state = ops.recurrent_gla(q, k, v, g=g)
    assert output.shape == (2, 100, 8, 64)
    return output, final_state


@example("ejkernel kernels/_xla/gla/_interface.py: recurrent_gla, packed variable-length")
def recurrent_gla_packed(ops):
    q_packed = jnp.ones((150, 8, 64))
    k_packed = jnp.ones((150, 8, 64))
    v_packed = jnp.ones((150, 8, 64))
    g_packed = jnp.ones((150, 8, 64))
    cu_seqlens = jnp.array([0, 50, 100, 150])
    output, _ = ops.recurrent_gla(q_packed, k_packed, v_packed,
                                  g=g_packed, cu_seqlens=cu_seqlens)
    assert output.shape == (150, 8, 64)
    return (output,)


@example("ejkernel kernels/_triton/gla/_triton_impl_fwd.py: module docstring")
def recurrent_gla_triton_doc(ops):
    batch, seq_len, num_heads, head_dim = 2, 1024, 8, 64
    q = jnp.ones((batch, seq_len, num_heads, head_dim))
    k = jnp.ones((batch, seq_len, num_heads, head_dim))
    v = jnp.ones((batch, seq_len, num_heads, head_dim))
    g = jnp.ones((batch, seq_len, num_heads, head_dim))

    output, final_state = ops.recurrent_gla(q, k, v, g=g)
    return output, final_state


# ---- ejkernel: kernels/_xla/lightning_attn (_interface.py, _xla_impl_fwd.py), Triton's

@example("ejkernel kernels/_xla/lightning_attn/_interface.py: lightning_attn")
def lightning_batched(ops):
    q = jnp.ones((2, 100, 8, 64))
    k = jnp.ones((2, 100, 8, 64))
    v = jnp.ones((2, 100, 8, 64))
    output, state = ops.lightning_attn(q, k, v, layer_idx=5, num_layers=24)
    assert output.shape == (2, 100, 8, 64)
    return output, state


@example("ejkernel kernels/_xla/lightning_attn/_xla_impl_fwd.py: lightning_attn, varlen")
def lightning_varlen(ops):
    q = jnp.ones((1, 150, 8, 64))
    k = jnp.ones((1, 150, 8, 64))
    v = jnp.ones((1, 150, 8, 64))
    cu_seqlens = jnp.array([0, 50, 100, 150])
    output, final_state = ops.lightning_attn(
        q, k, v, layer_idx=10, num_layers=24, cu_seqlens=cu_seqlens
    )
    return output, final_state


@example("ejkernel kernels/_triton/lightning_attn/_triton_impl_fwd.py: module docstring")
def lightning_triton_doc(ops):
    batch, seq_len, num_heads, head_dim = 2, 2048, 8, 64
    q = jnp.ones((batch, seq_len, num_heads, head_dim))
    k = jnp.ones((batch, seq_len, num_heads, head_dim))
    v = jnp.ones((batch, seq_len, num_heads, head_dim))

    output, final_state = ops.lightning_attn(q, k, v, layer_idx=5, num_layers=12)
    return output, final_state


# ---- ejkernel: modules/operations/gated_linear_attention.py, gla_attention's docstring.
# It leaves query, key, value, gates, gamma, cu_seqs undefined: shapes as its Args say
# (g_gamma "[batch, num_heads]"): equal heads and K == V, and for the plain call also
# K != V with 1 < Hk < H (grouped kv heads), which its signature documents (num_kv_heads).

SHAPES = {"equal": (2, 16, 4, 4, 8, 8), "gqa": (2, 16, 4, 2, 8, 6)}  # B, T, H, Hk, K, V


def _gla_inputs(shape):
    """query, key, value, gates (log decays), gamma (< 0) as JAX arrays (drawn by NumPy:
    jax.random compiles afresh for every shape)."""
    B, T, H, Hk, K, V = SHAPES[shape]
    r = np.random.default_rng(7)
    normal = lambda *shape: r.standard_normal(shape, np.float32)
    gates = -np.log1p(np.exp(-normal(B, T, H, K) - 2.0))  # log sigmoid
    return tuple(map(jnp.asarray, (normal(B, T, H, K), normal(B, T, Hk, K), normal(B, T, Hk, V),
                                   gates, -np.exp(normal(B, H) - 2.0))))


def _packed(x):  # [B, T, ...] -> [1, B*T, ...], the layout cu_seqlens wants
    return x.reshape(1, -1, *x.shape[2:])


def _gla_plain(ops, shape):
    query, key, value, gates, gamma = _gla_inputs(shape)
    out = ops.gla_attention(query, key, value)
    return (out,)


@example("ejkernel modules/operations/gated_linear_attention.py: gla_attention(query, key, "
         "value)")
def gla_attention_plain(ops):
    return _gla_plain(ops, "equal")


@example("ejkernel modules/operations/gated_linear_attention.py: gla_attention(query, key, "
         "value), K != V and 1 < Hk < H")
def gla_attention_plain_gqa(ops):
    return _gla_plain(ops, "gqa")


@example("ejkernel modules/operations/gated_linear_attention.py: g=gates, g_gamma=gamma")
def gla_attention_gated(ops):
    query, key, value, gates, gamma = _gla_inputs("equal")
    out = ops.gla_attention(query, key, value, g=gates, g_gamma=gamma)
    return (out,)


@example("ejkernel modules/operations/gated_linear_attention.py: cu_seqlens=cu_seqs")
def gla_attention_varlen(ops):
    query, key, value = map(_packed, _gla_inputs("equal")[:3])
    cu_seqs = jnp.array([0, 5, 16, 32])
    out = ops.gla_attention(query, key, value, cu_seqlens=cu_seqs)
    return (out,)


@example("ejkernel modules/operations/gated_linear_attention.py: platform=\"triton\"")
def gla_attention_triton(ops):
    query, key, value, gates, gamma = _gla_inputs("equal")
    out = ops.gla_attention(query, key, value, platform="triton")
    return (out,)


# ---- EasyDeL: easydel/layers/ops/gla.py, recurrent_gla's docstring, and the check
# that file runs (test_recurrent_gla). The docstring's `key` is a PRNG key it leaves
# undefined. Its D = 64, V = 32: ejkernel's recurrent_gla fails on K != V without an
# initial_state (the docstring's call), and runs with one (the file's check).

@example("EasyDeL easydel/layers/ops/gla.py: recurrent_gla's docstring")
def easydel_doc(ops):
    recurrent_gla = ops.easydel_recurrent_gla
    key = jax.random.PRNGKey(0)
    B, S, H, D, V = 1, 32, 4, 64, 32
    q = jax.random.normal(key, (B, S, H, D))
    k = jax.random.normal(key, (B, S, H, D))
    v = jax.random.normal(key, (B, S, H, V))
    gk = jax.nn.log_sigmoid(jax.random.normal(key, (B, S, H, D)))
    output, _ = recurrent_gla(q, k, v, gk, chunk_size=8)
    assert _ is None  # output_final_state=False
    return (output,)


@example("EasyDeL easydel/layers/ops/gla.py: test_recurrent_gla")
def easydel_file_check(ops):
    recurrent_gla = ops.easydel_recurrent_gla
    B, S, H, D, V = 1, 32, 4, 64, 32
    rng = jax.random.PRNGKey(0)
    keys = jax.random.split(rng, 5)
    query = jax.random.normal(keys[0], (B, S, H, D))
    key = jax.random.normal(keys[1], (B, S, H, D))
    value = jax.random.normal(keys[2], (B, S, H, V))
    gk = jax.nn.log_sigmoid(jax.random.normal(keys[3], (B, S, H, D)))
    h0 = jax.random.normal(keys[4], (B, H, D, V))
    o1, h1 = recurrent_gla(query, key, value, gk, initial_state=h0, output_final_state=True)
    chunk_size = 8
    o2, h2 = recurrent_gla(query, key, value, gk, initial_state=h0, chunk_size=chunk_size,
                           output_final_state=True)
    assert o1.shape == (B, S, H, V) and o2.shape == (B, S, H, V)
    assert h1.shape == (B, H, D, V) and h2.shape == (B, H, D, V)
    assert jnp.allclose(o1, o2, rtol=1e-5, atol=1e-5)
    assert jnp.allclose(h1, h2, rtol=1e-5, atol=1e-5)
    return o1, h1, o2, h2


# ---- the namespaces the examples run against

def _easydel_over(recurrent_gla):
    """EasyDeL's call over an ejkernel-convention recurrent_gla (for the oracle and
    ejkernel, which have no EasyDeL entry): scale=-1.0 means the default scale."""
    def call(query, key, value, gk, scale=-1.0, initial_state=None, chunk_size=0,
             dtype=None, output_final_state=False):
        o, s = recurrent_gla(query, key, value, g=gk, initial_state=initial_state,
                             softmax_scale=None if scale == -1.0 else scale)
        return o, s if output_final_state else None
    return call


def _gla_attention_over(recurrent):
    def call(q, k, v, g=None, g_gamma=None, initial_state=None, cu_seqlens=None, *,
             softmax_scale=None, reverse=False, return_state=False, platform=None):
        o, s = recurrent(q, k, v, g=g, g_gamma=g_gamma, softmax_scale=softmax_scale,
                         initial_state=initial_state, reverse=reverse, cu_seqlens=cu_seqlens)
        return (o, s) if return_state else o
    return call


ORACLE = types.SimpleNamespace(
    recurrent=oracle.recurrent, recurrent_gla=oracle.recurrent_gla,
    lightning_attn=oracle.lightning_attn, gla_attention=_gla_attention_over(oracle.recurrent),
    easydel_recurrent_gla=_easydel_over(oracle.recurrent_gla))

JAX_OPS = types.SimpleNamespace(
    recurrent=jax_side.recurrent, recurrent_gla=jax_side.recurrent_gla,
    lightning_attn=jax_side.lightning_attn, gla_attention=jax_side.gla_attention,
    easydel_recurrent_gla=jax_side.easydel.recurrent_gla)


def _torch_call(fn):
    """`fn` (a torch_side op) called with the example's JAX arrays as torch tensors;
    its tensors come back as NumPy arrays."""
    def call(*args, **kwargs):
        to_torch = lambda x: torch.from_numpy(np.array(x)) if isinstance(x, jax.Array) else x
        out = fn(*map(to_torch, args), **{n: to_torch(x) for n, x in kwargs.items()})
        back = lambda x: x.numpy() if isinstance(x, torch.Tensor) else x
        return tuple(map(back, out)) if isinstance(out, tuple) else back(out)
    return call


TORCH_OPS = types.SimpleNamespace(
    recurrent=_torch_call(torch_side.recurrent),
    recurrent_gla=_torch_call(torch_side.recurrent_gla),
    lightning_attn=_torch_call(torch_side.lightning_attn),
    gla_attention=_torch_call(torch_side.gla_attention),
    easydel_recurrent_gla=_torch_call(torch_side.easydel.recurrent_gla))

# the one Triton-interpreter case runs from JAX only (the same kernels as from PyTorch)
TORCH_SKIPS = {"gla_attention_triton"}


@functools.cache
def reference(name):
    return EXAMPLES[name][1](ORACLE)


@functools.cache
def ours_jax(name):
    return EXAMPLES[name][1](JAX_OPS)


def assert_matches(got, want, tol=TOLERANCE["float32"]):
    """got against want (the float64 oracle, or ejkernel's float32): in float32's range,
    the same non-finite entries (the examples with gates of +1 overflow), and on the
    finite ones an error below `tol` of the largest magnitude along the last axis."""
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float32).astype(np.float64)  # overflows where float32 does
    assert got.shape == want.shape
    finite = np.isfinite(want)
    assert np.array_equal(np.isfinite(got), finite)
    assert np.array_equal(got[~finite], want[~finite])
    got, want = np.where(finite, got, 0.0), np.where(finite, want, 0.0)
    scale = np.maximum(np.abs(want).max(axis=-1, keepdims=True), 1e-6 * np.abs(want).max())
    err = np.abs(got - want) / np.maximum(scale, 1e-30)
    assert err.max(initial=0.0) <= tol, f"max error {err.max():.2e} of the row's magnitude"


def assert_all_match(got, want, tol=TOLERANCE["float32"]):
    assert len(got) == len(want)
    for x, y in zip(got, want):
        assert_matches(x, y, tol)


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_example_matches_oracle(name):
    """The example as written, against ours from JAX and from PyTorch: the oracle's
    numbers on every output."""
    assert_all_match(ours_jax(name), reference(name))
    if name not in TORCH_SKIPS:
        assert_all_match(EXAMPLES[name][1](TORCH_OPS), reference(name))


# ---- ejkernel's own functions

def _ejkernel_ops():
    # read at ejkernel's import: pick its configs by heuristics, not by its autotuner
    # (which times every candidate, ~15 s a call here, and keeps a cache on disk)
    os.environ.setdefault("EJKERNEL_AUTOTUNE_POLICY", "heuristics")
    from ejkernel.kernels import xla
    from ejkernel.modules import gla_attention

    return types.SimpleNamespace(
        recurrent=xla.recurrent, recurrent_gla=xla.recurrent_gla,
        lightning_attn=xla.lightning_attn, gla_attention=gla_attention,
        easydel_recurrent_gla=_easydel_over(xla.recurrent_gla))


# What ejkernel 0.0.80.3 does with its own examples when it fails: (exception type,
# message start, why). The examples printed in its Triton modules run on its XLA
# functions (the same functions by its contract; its Triton kernels need a GPU, as its
# gla_attention platform="triton" example does).
BROADCAST = "add got incompatible shapes for broadcasting"
POSITIONAL_ONLY = (TypeError, "gla_attention() got some positional-only arguments passed "
                   "as keyword arguments", "its g, g_gamma, cu_seqlens are positional-only")
EJKERNEL_FAILS = {
    "recurrent_gla_packed": (Exception, "Type-check error", "its type hints refuse the "
                             "documented packed [total, H, K] layout"),
    "gla_attention_gated": POSITIONAL_ONLY, "gla_attention_varlen": POSITIONAL_ONLY,
    "gla_attention_plain_gqa": (TypeError, BROADCAST, "its XLA path fails on K != V and "
                                "on 1 < Hk < H"),
    "easydel_doc": (TypeError, BROADCAST, "its XLA path fails on K != V (D = 64, V = 32) "
                    "without an initial_state"),
}
if jax.default_backend() != "gpu":
    EJKERNEL_FAILS["gla_attention_triton"] = (
        ValueError, "No implementation found for algorithm=gla, platform=triton",
        "its Triton kernels need a GPU; ours run in Triton's interpreter")

# the examples that fail only through ejkernel's positional-only markers, called
# positionally, so that ejkernel's numbers are compared all the same
POSITIONAL = {
    "gla_attention_gated": lambda f, query, key, value, gates, gamma:
        f(query, key, value, gates, gamma),
    "gla_attention_varlen": lambda f, query, key, value, gates, gamma:
        f(*map(_packed, (query, key, value)), None, None, None, jnp.array([0, 5, 16, 32])),
}


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_example_against_ejkernel(name):
    """ejkernel's own function on the same example: its numbers equal ours, or it fails
    (EJKERNEL_FAILS says how and why) while ours gives the oracle's numbers."""
    if not HAVE_EJKERNEL:
        pytest.skip(NO_EJKERNEL)
    ejk = _ejkernel_ops()
    ours = ours_jax(name)
    if name not in EJKERNEL_FAILS:
        assert_all_match(ours, EXAMPLES[name][1](ejk))
        return
    exc, start, why = EJKERNEL_FAILS[name]
    with pytest.raises(exc) as info:
        EXAMPLES[name][1](ejk)
    assert str(info.value).startswith(start), (why, str(info.value)[:300])
    assert_all_match(ours, reference(name))  # ours works where ejkernel's example fails
    if name in POSITIONAL:
        theirs = POSITIONAL[name](ejk.gla_attention, *_gla_inputs("equal"))
        assert_all_match(ours, (theirs,))


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
