"""Drop-in for ejkernel and EasyDeL: every example printed in their documentation for
`recurrent`, `recurrent_gla`, `lightning_attn`, `gla_attention` (ejkernel 0.0.80.3) and
EasyDeL's `recurrent_gla`, run as written against ours (JAX, and PyTorch through a
conversion), checked against the float64 oracle and, where ejkernel is installed (the
bench extra), against ejkernel's own functions. Where ejkernel's own example fails, the
test asserts that it does and that ours computes the oracle's numbers. The call
conventions beyond the examples: tests/test_dropin_api.py."""

import functools
import importlib.util
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jax_side
import torch_side
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
