"""EasyDeL's `recurrent_gla` (easydel.layers.ops.gla) on this project's kernels: the same
call and return convention. torch_side/easydel.py is the PyTorch twin."""

import jax.numpy as jnp

from bridge import variants
from . import variants as named


def recurrent_gla(query, key, value, gk, scale=-1.0, initial_state=None, chunk_size=0,
                  dtype=jnp.float32, output_final_state=False):
    """EasyDeL's call: `jax_side.recurrent_gla(query, key, value, g=gk)` in `dtype`.

    query, key, gk [B,S,H,D], value [B,S,H,V] (key and value may have fewer heads),
    initial_state [B,H,D,V]. scale=-1.0 means D ** -0.5; the inputs are cast to `dtype`
    (a floating dtype) and both outputs come back in it (accumulation stays float32);
    chunk_size (an int >= 0) changes nothing: every path already works in 64-token
    chunks with bounded memory. Returns (o [B,S,H,V], final_state [B,H,D,V]), or
    (o, None) when output_final_state is False.

    >>> import jax, jax_side
    >>> q, k = jax.random.normal(jax.random.key(0), (2, 1, 32, 4, 16))
    >>> v = jax.random.normal(jax.random.key(1), (1, 32, 4, 8))
    >>> gk = jax.nn.log_sigmoid(jax.random.normal(jax.random.key(2), (1, 32, 4, 16)))
    >>> o, final_state = jax_side.easydel.recurrent_gla(q, k, v, gk, output_final_state=True)
    >>> o.shape, final_state.shape
    ((1, 32, 4, 8), (1, 4, 16, 8))
    """
    softmax_scale = variants.easydel_scale(scale, chunk_size, output_final_state)
    try:
        dtype = jnp.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype: expected a floating dtype, got {dtype!r}") from None
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"dtype: expected a floating dtype, got {dtype}")
    inputs = [None if x is None else jnp.asarray(x).astype(dtype)
              for x in (query, key, value, gk, initial_state)]
    o, final_state = named.recurrent_gla(*inputs[:3], g=inputs[3], initial_state=inputs[4],
                                         softmax_scale=softmax_scale)
    return o.astype(dtype), final_state.astype(dtype) if output_final_state else None
