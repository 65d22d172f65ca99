"""The named variants of SPEC.md in PyTorch, each one call of `torch_side.recurrent`.

jax_side/variants.py is the JAX twin, with the same signatures; what the two share
(ejkernel's aliases, the Lightning decay, the checks) is bridge/variants.py.
"""

import torch

from bridge import variants
from .ops import recurrent


def recurrent_gla(q=None, k=None, v=None, g=None, g_gamma=None, softmax_scale=None,
                  initial_state=None, reverse=False, cu_seqlens=None, block_k=None,
                  block_v=None, num_warps=None, num_stages=None, *, query=None, key=None,
                  value=None, **options):
    """Gated linear attention (GLA): the recurrence with a data-dependent key-dim gate.

    q [B,T,H,K], k [B,T,Hk,K], v [B,T,Hk,V] (H a multiple of Hk), or packed [total,H,*]
    with cu_seqlens [N+1]; g [B,T,H,K] log decays (or [B,T,H], one per head and step);
    g_gamma [H] or [N,H] a constant log decay per head; initial_state [N,H,K,V]. Each step
    S_t = diag(exp(g_t + g_gamma)) S_{t-1} + k_t^T v_t, o_t = softmax_scale * q_t S_t
    (softmax_scale defaults to K ** -0.5; reverse=True runs each sequence from its end).
    Returns (o [B,T,H,V] in q's dtype, final_state [N,H,K,V] float32).

    query, key, value: ejkernel's names for q, k, v. block_k, block_v, num_warps,
    num_stages: ejkernel's Triton tiling, accepted and ignored. options: `recurrent`'s
    keywords (platform, mode, context_group).

    >>> import torch, torch_side
    >>> q, k = torch.randn(2, 2, 32, 4, 16)
    >>> v = torch.randn(2, 32, 4, 8)
    >>> g = torch.nn.functional.logsigmoid(torch.randn(2, 32, 4, 16))
    >>> o, final_state = torch_side.recurrent_gla(q, k, v, g=g)
    >>> tuple(o.shape), tuple(final_state.shape)
    ((2, 32, 4, 8), (2, 4, 16, 8))
    """
    q, k, v = variants.take_aliases(q, k, v, query, key, value)
    return recurrent(q, k, v, g=g, g_gamma=g_gamma, softmax_scale=softmax_scale,
                     initial_state=initial_state, reverse=reverse, cu_seqlens=cu_seqlens,
                     **options)


def lightning_attn(q=None, k=None, v=None, layer_idx=None, num_layers=None,
                   softmax_scale=None, initial_state=None, reverse=False, cu_seqlens=None,
                   block_k=None, block_v=None, num_warps=None, num_stages=None, *,
                   query=None, key=None, value=None, **options):
    """Lightning attention: the recurrence with a constant decay per head, set by the
    layer's depth: g_gamma = -(8/H * (1 - layer_idx/num_layers)) * arange(H), no
    data-dependent gates.

    q [B,T,H,K], k [B,T,Hk,K], v [B,T,Hk,V], or packed [total,H,*] with cu_seqlens [N+1];
    layer_idx, num_layers ints with 0 <= layer_idx < num_layers; initial_state [N,H,K,V].
    Returns (o [B,T,H,V] in q's dtype, final_state [N,H,K,V] float32). The other
    arguments are recurrent_gla's.

    >>> import torch, torch_side
    >>> q, k = torch.randn(2, 2, 32, 4, 16)
    >>> v = torch.randn(2, 32, 4, 8)
    >>> o, final_state = torch_side.lightning_attn(q, k, v, layer_idx=3, num_layers=24)
    >>> tuple(o.shape), tuple(final_state.shape)
    ((2, 32, 4, 8), (2, 4, 16, 8))
    """
    q, k, v = variants.take_aliases(q, k, v, query, key, value)
    variants.check_lightning(layer_idx, num_layers)
    gamma = variants.lightning_g_gamma(q.shape[-2], layer_idx, num_layers)
    # torch.tensor of Python floats (exact for float32 values), not from_numpy: traceable
    g_gamma = torch.tensor(gamma.tolist(), dtype=torch.float32, device=q.device)
    return recurrent(q, k, v, g_gamma=g_gamma, softmax_scale=softmax_scale,
                     initial_state=initial_state, reverse=reverse, cu_seqlens=cu_seqlens,
                     **options)


def gla_attention(q=None, k=None, v=None, g=None, g_gamma=None, initial_state=None,
                  cu_seqlens=None, *, softmax_scale=None, reverse=False, return_state=False,
                  platform=None, cfg=None, query=None, key=None, value=None, **options):
    """ejkernel's gla_attention entry: recurrent_gla's computation, returning
    o [B,T,H,V], or (o, final_state [N,H,K,V]) with return_state=True.

    q [B,T,H,K], k [B,T,Hk,K], v [B,T,Hk,V], or packed [total,H,*] with cu_seqlens [N+1];
    g [B,T,H,K] or [B,T,H] and g_gamma [H] or [N,H] log decays; initial_state [N,H,K,V].
    platform=None means cfg.platform when an ejkernel config `cfg` is given (its block
    sizes are ignored), else "auto". Unlike ejkernel's, nothing is positional-only.

    >>> import torch, torch_side
    >>> q, k = torch.randn(2, 2, 32, 4, 16)
    >>> v = torch.randn(2, 32, 4, 8)
    >>> g = torch.nn.functional.logsigmoid(torch.randn(2, 32, 4, 16))
    >>> tuple(torch_side.gla_attention(q, k, v, g=g).shape)
    (2, 32, 4, 8)
    """
    q, k, v = variants.take_aliases(q, k, v, query, key, value)
    o, final_state = recurrent(q, k, v, g=g, g_gamma=g_gamma, softmax_scale=softmax_scale,
                               initial_state=initial_state, reverse=reverse,
                               cu_seqlens=cu_seqlens, platform=variants.config_platform(
                                   platform, cfg), **options)
    return (o, final_state) if return_state else o
