"""What the named variants of SPEC.md share across frameworks, written once.

Each framework defines its variants as plain functions over its own `recurrent`
(torch_side/variants.py, jax_side/variants.py, and each side's easydel.py for EasyDeL's
call); what they have in common is here: ejkernel's argument aliases (`take_aliases`),
the Lightning decay (`check_lightning`, `lightning_g_gamma`), gla_attention's platform
from an ejkernel config (`config_platform`) and EasyDeL's argument rules
(`easydel_scale`).
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


def config_platform(platform, cfg):
    """gla_attention's platform: `platform`, or with None `cfg.platform` when an ejkernel
    config is given (its block sizes are ignored), else "auto"."""
    if platform is None:
        platform = getattr(cfg, "platform", None)
        platform = getattr(platform, "value", platform) or "auto"  # ejkernel's enum
    return platform


def easydel_scale(scale, chunk_size, output_final_state):
    """EasyDeL's argument rules: a TypeError / ValueError naming `chunk_size` (an int >= 0,
    which changes nothing) or `output_final_state` (a bool); returns the softmax_scale
    `scale` means (None, the default K ** -0.5, for EasyDeL's sentinel -1.0)."""
    if isinstance(chunk_size, (bool, np.bool_)) or not isinstance(chunk_size, numbers.Integral):
        raise TypeError(f"chunk_size: expected an int, got {type(chunk_size).__name__}")
    if chunk_size < 0:
        raise ValueError(f"chunk_size: expected >= 0, got {chunk_size}")
    if not isinstance(output_final_state, (bool, np.bool_)):
        raise TypeError(f"output_final_state: expected a bool, got "
                        f"{type(output_final_state).__name__}")
    sentinel = isinstance(scale, numbers.Real) and not isinstance(scale, bool) and scale == -1.0
    return None if sentinel else scale


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
