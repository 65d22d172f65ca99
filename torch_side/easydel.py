"""EasyDeL's `recurrent_gla` (easydel.layers.ops.gla, a JAX function) as a PyTorch op on
this project's kernels:

    recurrent_gla(query, key, value, gk, scale=-1.0, initial_state=None, chunk_size=0,
                  dtype=torch.float32, output_final_state=False) -> (o, final_state or None)

the same call and return convention with torch dtypes, computing
`torch_side.recurrent_gla(query, key, value, g=gk)` (see
`bridge.variants.easydel_recurrent_gla` for each argument).
"""

import torch

from bridge import variants
from . import ops


def _as_dtype(dtype):
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype: expected a floating torch.dtype, got {dtype!r}")
    return dtype


recurrent_gla = variants.easydel_recurrent_gla(
    ops.recurrent_gla, torch.float32, _as_dtype, lambda x, dtype: x.to(dtype))
