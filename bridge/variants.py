"""The named variants of SPEC.md, written once over a framework's `recurrent`.

`named_variants(recurrent, constant)` returns (recurrent_gla, lightning_attn,
gla_attention) for a framework; `constant(np_array, like)` turns a NumPy array
into that framework's array on `like`'s device. `lightning_g_gamma` is the
Lightning decay formula both frameworks and both layers use.
"""

import numbers

import numpy as np

RECURRENT_DOC = """The general gated recurrence of SPEC.md.

    q [B,T,H,K], k [B,T,Hk,K], v [B,T,Hk,V] (or packed [total,H,*] with
    cu_seqlens); g [B,T,H(,K)], gk [B,T,H,K], gv [B,T,H,V] log decays; g_gamma
    [H] or [N,H]; initial_state [N,H,K,V]. Returns (o [B,T,H,V] in q's dtype,
    final_state [N,H,K,V] float32). `platform` and `mode` pick the
    implementation (see the module's docstring).
    """


def named_variants(recurrent, constant):
    def recurrent_gla(q, k, v, g=None, g_gamma=None, softmax_scale=None, initial_state=None,
                      reverse=False, cu_seqlens=None, **options):
        """GLA: `g` is the key-dim log decay [B,T,H,K] (or one per head, [B,T,H])."""
        return recurrent(q, k, v, g=g, g_gamma=g_gamma, softmax_scale=softmax_scale,
                         initial_state=initial_state, reverse=reverse, cu_seqlens=cu_seqlens,
                         **options)

    def lightning_attn(q, k, v, layer_idx, num_layers, softmax_scale=None, initial_state=None,
                       reverse=False, cu_seqlens=None, **options):
        """Lightning attention: the constant per-head decay
        g_gamma = -(8/H * (1 - layer_idx/num_layers)) * arange(H), no other gates."""
        H = q.shape[-2]
        check_lightning(layer_idx, num_layers)
        g_gamma = constant(lightning_g_gamma(H, layer_idx, num_layers), q)
        return recurrent(q, k, v, g_gamma=g_gamma, softmax_scale=softmax_scale,
                         initial_state=initial_state, reverse=reverse, cu_seqlens=cu_seqlens,
                         **options)

    def gla_attention(q, k, v, g=None, g_gamma=None, initial_state=None, cu_seqlens=None, /, *,
                      softmax_scale=None, reverse=False, return_state=False, platform=None,
                      **options):
        """ejkernel-style entry: returns o, or (o, final_state) with return_state=True."""
        o, final_state = recurrent(q, k, v, g=g, g_gamma=g_gamma, softmax_scale=softmax_scale,
                                   initial_state=initial_state, reverse=reverse,
                                   cu_seqlens=cu_seqlens, platform=platform or "auto",
                                   **options)
        return (o, final_state) if return_state else o

    return recurrent_gla, lightning_attn, gla_attention


def check_lightning(layer_idx, num_layers) -> None:
    """Validate the Lightning attention layer position."""
    for name, x in (("layer_idx", layer_idx), ("num_layers", num_layers)):
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
