"""The named variants of SPEC.md, written once over a framework's `recurrent`.

`named_variants(recurrent, constant)` returns (recurrent_gla, lightning_attn,
gla_attention) for a framework; `constant(np_array, like)` turns a NumPy array
into that framework's array on `like`'s device. `easydel_recurrent_gla` builds
EasyDeL's call over a framework's recurrent_gla. `lightning_g_gamma` is the
Lightning decay formula both frameworks and both layers use. `take_aliases`
resolves ejkernel's names query/key/value for q/k/v.
"""

import numbers

import numpy as np

RECURRENT_DOC = """The general gated recurrence of SPEC.md.

    q [B,T,H,K], k [B,T,Hk,K], v [B,T,Hk,V] (or packed [total,H,*] with
    cu_seqlens); g [B,T,H(,K)], gk [B,T,H,K], gv [B,T,H,V] log decays; g_gamma
    [H] or [N,H]; initial_state [N,H,K,V]. Returns (o [B,T,H,V] in q's dtype,
    final_state [N,H,K,V] float32). `platform` and `mode` pick the
    implementation (see the module's docstring). `query`, `key`, `value` are
    ejkernel's names for q, k, v (give one of each pair); `block_k`, `block_v`,
    `num_warps`, `num_stages` (ejkernel's Triton tiling, in its positional order) are
    accepted and ignored: the launch plans pick their own.
    """

ALIASES = (("q", "query"), ("k", "key"), ("v", "value"))


def take_aliases(q, k, v, query, key, value):
    """(q, k, v), each given as itself or by its ejkernel name (query, key, value):
    a TypeError naming the argument when one is missing or given both ways."""
    out = []
    for (name, alias), x, y in zip(ALIASES, (q, k, v), (query, key, value)):
        if x is not None and y is not None:
            raise TypeError(f"{name}: given twice, as {name}= and as {alias}= (ejkernel's "
                            f"name for it); give one")
        if x is None and y is None:
            raise TypeError(f"{name}: missing (give {name}, or {alias}= as ejkernel names it)")
        out.append(y if x is None else x)
    return out


def named_variants(recurrent, constant):
    def recurrent_gla(q=None, k=None, v=None, g=None, g_gamma=None, softmax_scale=None,
                      initial_state=None, reverse=False, cu_seqlens=None, block_k=None,
                      block_v=None, num_warps=None, num_stages=None, *, query=None,
                      key=None, value=None, **options):
        """GLA: `g` is the key-dim log decay [B,T,H,K] (or one per head, [B,T,H]).
        block_k ... num_stages: ejkernel's, ignored (as by `recurrent`)."""
        q, k, v = take_aliases(q, k, v, query, key, value)
        return recurrent(q, k, v, g=g, g_gamma=g_gamma, softmax_scale=softmax_scale,
                         initial_state=initial_state, reverse=reverse, cu_seqlens=cu_seqlens,
                         **options)

    def lightning_attn(q=None, k=None, v=None, layer_idx=None, num_layers=None,
                       softmax_scale=None, initial_state=None, reverse=False, cu_seqlens=None,
                       block_k=None, block_v=None, num_warps=None, num_stages=None, *,
                       query=None, key=None, value=None, **options):
        """Lightning attention: the constant per-head decay
        g_gamma = -(8/H * (1 - layer_idx/num_layers)) * arange(H), no other gates.
        block_k ... num_stages: ejkernel's, ignored."""
        q, k, v = take_aliases(q, k, v, query, key, value)
        check_lightning(layer_idx, num_layers)
        g_gamma = constant(lightning_g_gamma(q.shape[-2], layer_idx, num_layers), q)
        return recurrent(q, k, v, g_gamma=g_gamma, softmax_scale=softmax_scale,
                         initial_state=initial_state, reverse=reverse, cu_seqlens=cu_seqlens,
                         **options)

    def gla_attention(q=None, k=None, v=None, g=None, g_gamma=None, initial_state=None,
                      cu_seqlens=None, *, softmax_scale=None, reverse=False, return_state=False,
                      platform=None, cfg=None, query=None, key=None, value=None, **options):
        """ejkernel-style entry: returns o, or (o, final_state) with return_state=True.
        `platform=None` is "auto", or `cfg.platform` when an ejkernel config is given
        (its block sizes are ignored)."""
        q, k, v = take_aliases(q, k, v, query, key, value)
        if platform is None:
            platform = getattr(cfg, "platform", None)
            platform = getattr(platform, "value", platform) or "auto"  # ejkernel's enum
        o, final_state = recurrent(q, k, v, g=g, g_gamma=g_gamma, softmax_scale=softmax_scale,
                                   initial_state=initial_state, reverse=reverse,
                                   cu_seqlens=cu_seqlens, platform=platform, **options)
        return (o, final_state) if return_state else o

    return recurrent_gla, lightning_attn, gla_attention


def easydel_recurrent_gla(recurrent_gla, float32, as_dtype, cast):
    """EasyDeL's `recurrent_gla` over a framework's `recurrent_gla`; `float32` is the
    framework's float32 dtype (the default of `dtype`), `as_dtype(dtype)` the framework
    dtype or a TypeError naming `dtype`, `cast(x, dtype)` converts an array."""

    def recurrent_gla_easydel(query, key, value, gk, scale=-1.0, initial_state=None,
                              chunk_size=0, dtype=float32, output_final_state=False):
        """EasyDeL's call: query, key, gk [B,S,H,D], value [B,S,H,V] (key/value may have
        fewer heads here), initial_state [B,H,D,V]. `scale=-1.0` means D ** -0.5; the
        inputs are cast to `dtype` and both outputs come back in it (accumulation stays
        float32); `chunk_size` (an int >= 0) changes nothing: every path already works
        in 64-token chunks with bounded memory. Returns (o, final_state), or (o, None)
        when output_final_state is False."""
        if isinstance(chunk_size, (bool, np.bool_)) or not isinstance(chunk_size, numbers.Integral):
            raise TypeError(f"chunk_size: expected an int, got {type(chunk_size).__name__}")
        if chunk_size < 0:
            raise ValueError(f"chunk_size: expected >= 0, got {chunk_size}")
        if not isinstance(output_final_state, (bool, np.bool_)):
            raise TypeError(f"output_final_state: expected a bool, got "
                            f"{type(output_final_state).__name__}")
        dtype = as_dtype(dtype)
        sentinel = isinstance(scale, numbers.Real) and not isinstance(scale, bool) and scale == -1.0
        inputs = [None if x is None else cast(x, dtype)
                  for x in (query, key, value, gk, initial_state)]
        o, final_state = recurrent_gla(*inputs[:3], g=inputs[3], initial_state=inputs[4],
                                       softmax_scale=None if sentinel else scale)
        return cast(o, dtype), cast(final_state, dtype) if output_final_state else None

    recurrent_gla_easydel.__name__ = recurrent_gla_easydel.__qualname__ = "recurrent_gla"
    return recurrent_gla_easydel


def check_lightning(layer_idx, num_layers) -> None:
    """Validate the Lightning attention layer position."""
    for name, x in (("layer_idx", layer_idx), ("num_layers", num_layers)):
        if x is None:
            raise TypeError(f"{name}: missing (an int)")
        if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Integral):
            raise TypeError(f"{name}: expected an int, got {type(x).__name__}")
    if num_layers < 1:
        raise ValueError(f"num_layers: expected >= 1, got {num_layers}")
    if not 0 <= layer_idx < num_layers:
        raise ValueError(f"layer_idx: expected 0 <= layer_idx < num_layers={num_layers}, "
                         f"got {layer_idx}")


def lightning_g_gamma(H: int, layer_idx: int, num_layers: int) -> np.ndarray:
    """SPEC.md's Lightning decay, float32 [H]: -(8/H * (1 - layer_idx/num_layers)) * arange(H),
    the product taken in float32 as the formula reads (torch and NumPy both do so)."""
    coef = np.float32(-(8.0 / H * (1.0 - layer_idx / num_layers)))
    return coef * np.arange(H, dtype=np.float32)
