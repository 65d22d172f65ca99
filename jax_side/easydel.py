"""EasyDeL's `recurrent_gla` (easydel.layers.ops.gla) on this project's kernels:

    recurrent_gla(query, key, value, gk, scale=-1.0, initial_state=None, chunk_size=0,
                  dtype=jnp.float32, output_final_state=False) -> (o, final_state or None)

the same call and return convention, computing `jax_side.recurrent_gla(query, key, value,
g=gk)` (see `bridge.variants.easydel_recurrent_gla` for each argument).
"""

import jax.numpy as jnp

from bridge import variants
from . import ops


def _as_dtype(dtype):
    try:
        dtype = jnp.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype: expected a floating dtype, got {dtype!r}") from None
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"dtype: expected a floating dtype, got {dtype}")
    return dtype


recurrent_gla = variants.easydel_recurrent_gla(
    ops.recurrent_gla, jnp.float32, _as_dtype, lambda x, dtype: jnp.asarray(x).astype(dtype))
