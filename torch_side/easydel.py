"""EasyDeL's `recurrent_gla` (easydel.layers.ops.gla, a JAX function) as a PyTorch op on
this project's kernels: the same call and return convention with torch dtypes.
jax_side/easydel.py is the JAX twin."""

import torch

from bridge import variants
from . import variants as named


def recurrent_gla(query, key, value, gk, scale=-1.0, initial_state=None, chunk_size=0,
                  dtype=torch.float32, output_final_state=False):
    """EasyDeL's call: `torch_side.recurrent_gla(query, key, value, g=gk)` in `dtype`.

    query, key, gk [B,S,H,D], value [B,S,H,V] (key and value may have fewer heads),
    initial_state [B,H,D,V]. scale=-1.0 means D ** -0.5; the inputs are cast to `dtype`
    (a floating torch.dtype) and both outputs come back in it (accumulation stays
    float32); chunk_size (an int >= 0) changes nothing: every path already works in
    64-token chunks with bounded memory. Returns (o [B,S,H,V], final_state [B,H,D,V]),
    or (o, None) when output_final_state is False.

    >>> import torch, torch_side
    >>> q, k = torch.randn(2, 1, 32, 4, 16)
    >>> v = torch.randn(1, 32, 4, 8)
    >>> gk = torch.nn.functional.logsigmoid(torch.randn(1, 32, 4, 16))
    >>> o, final_state = torch_side.easydel.recurrent_gla(q, k, v, gk, output_final_state=True)
    >>> tuple(o.shape), tuple(final_state.shape)
    ((1, 32, 4, 8), (1, 4, 16, 8))
    """
    softmax_scale = variants.easydel_scale(scale, chunk_size, output_final_state)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype: expected a floating torch.dtype, got {dtype!r}")
    inputs = [None if x is None else x.to(dtype)
              for x in (query, key, value, gk, initial_state)]
    o, final_state = named.recurrent_gla(*inputs[:3], g=inputs[3], initial_state=inputs[4],
                                         softmax_scale=softmax_scale)
    return o.to(dtype), final_state.to(dtype) if output_final_state else None
