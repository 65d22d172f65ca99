"""JAX layers as pure functions: init_gla / gla_apply and init_lightning / lightning_apply.

Same math, parameter names and layouts as torch_side.layers (see bridge.weights: a
Linear weight is [out, in] and is applied as x @ W.T; the output norm is fla's
`g_norm_swish_gate` when config.fuse_norm), the same options (feature_map on q and k,
clamp_min on the log-gate), same state semantics:

    apply(params, x [B,T,D], config, *, attention_mask [B,T], cu_seqlens [N+1],
          state [N,H,K,V], use_cache, mode, platform, context_axis)
        -> o [B,T,D] | (o, state float32)

`context_axis` (a mesh axis name, inside jax.shard_map with x's time axis sharded
over it) runs the attention context-parallel (jax_side.context); everything else in
the layer is per token. `config` (a frozen bridge.weights.LayerConfig) and
mode/platform/use_cache/context_axis are static;
everything else may be traced, so jax.jit(partial(gla_apply, config=cfg)) and jax.grad work.
"""

import jax
import jax.numpy as jnp
import numpy as np

from bridge import variants
from bridge.weights import LayerConfig, check_inputs, check_params, param_shapes
from . import ops
from .variants import lightning_attn, recurrent_gla


def _init(rng, config: LayerConfig, kind: str, dtype=jnp.float32) -> dict:
    if not isinstance(config, LayerConfig):
        raise TypeError(f"config: expected a LayerConfig, got {type(config).__name__}")
    if config.kind != kind:
        raise ValueError(f"config: expected kind={kind!r}, got {config.kind!r}")
    params = {}
    for name, shape in param_shapes(config).items():
        rng, key = jax.random.split(rng)
        if name == config.norm_param:
            params[name] = jnp.ones(shape, dtype)
        else:  # torch.nn.Linear's default: U(-1/sqrt(fan_in), 1/sqrt(fan_in)), bias alike
            fan_in = param_shapes(config)[name.replace(".bias", ".weight")][-1]
            bound = 1.0 / np.sqrt(fan_in)
            params[name] = jax.random.uniform(key, shape, dtype, -bound, bound)
    return params


def init_gla(rng, config: LayerConfig, dtype=jnp.float32) -> dict:
    """Parameters of a GLA layer ({name: array}, names of bridge.weights.param_shapes)."""
    return _init(rng, config, "gla", dtype)


def init_lightning(rng, config: LayerConfig, dtype=jnp.float32) -> dict:
    """Parameters of a Lightning attention layer."""
    return _init(rng, config, "lightning", dtype)


# fla's feature maps for q and k (bridge.weights.FEATURE_MAPS); "gelu" is its tanh form
FEATURE_MAPS = {
    "relu": jax.nn.relu, "sigmoid": jax.nn.sigmoid, "logsigmoid": jax.nn.log_sigmoid,
    "swish": jax.nn.silu, "silu": jax.nn.silu, "sqrelu": lambda x: jnp.square(jax.nn.relu(x)),
    "gelu": lambda x: jax.nn.gelu(x, approximate=True),
}


def linear(x, w, b=None):
    """x [..., in] @ w.T (+ b): w [out, in] as torch stores it, cast to x's dtype."""
    y = x @ w.T.astype(x.dtype)
    return y if b is None else y + b.astype(y.dtype)


def rms_norm(x, w, eps):
    """RMSNorm over the last dim with weight w, in float32, returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * w.astype(jnp.float32)).astype(x.dtype)


def _apply(params, x, config, kind, attention_mask, cu_seqlens, state, use_cache, mode,
           platform, context_axis):
    if not isinstance(config, LayerConfig) or config.kind != kind:
        raise ValueError(f"config: expected a LayerConfig with kind={kind!r}, got {config!r}")
    check_params(params, config)
    c = config
    check_inputs(c, x, attention_mask, cu_seqlens, state)
    H, Hk, K, V = c.num_heads, c.kv_heads, c.head_k_dim, c.head_v_dim
    lead = x.shape[:-1]
    q = linear(x, params["q_proj.weight"]).reshape(*lead, H, K)
    k = linear(x, params["k_proj.weight"]).reshape(*lead, Hk, K)
    v = linear(x, params["v_proj.weight"]).reshape(*lead, Hk, V)
    if c.feature_map is not None:  # before the mask: padding keeps q = k = 0 (a map may
        # send 0 elsewhere), so its outputs stay zero
        q, k = (FEATURE_MAPS[c.feature_map](t) for t in (q, k))
    mask = None if attention_mask is None else attention_mask.astype(bool)[..., None, None]
    if mask is not None:  # padding: zero q/k/v and no decay, so the state passes unchanged
        q, k, v = (jnp.where(mask, t, jnp.zeros((), t.dtype)) for t in (q, k, v))
    opts = dict(initial_state=state, cu_seqlens=cu_seqlens, mode=mode, platform=platform,
                context_axis=context_axis)
    if kind == "gla":
        low = linear(x, params["gk_proj.0.weight"])
        gk = linear(low, params["gk_proj.1.weight"], params["gk_proj.1.bias"])
        gk = jax.nn.log_sigmoid(gk.astype(jnp.float32)) / c.gate_logit_normalizer
        if c.clamp_min is not None:
            gk = jnp.maximum(gk, c.clamp_min)
        gk = jnp.repeat(gk.reshape(*lead, Hk, K), H // Hk, axis=-2)  # head h <- kv h//G
        if mask is not None:
            gk = jnp.where(mask, gk, 0.0)
        o, final_state = recurrent_gla(q, k, v, g=gk, **opts)
    elif mask is None:
        o, final_state = lightning_attn(q, k, v, c.layer_idx, c.num_layers, **opts)
    else:
        gamma = jnp.asarray(variants.lightning_g_gamma(H, c.layer_idx, c.num_layers))
        g = jnp.where(mask[..., 0], gamma, 0.0)  # [B,T,H]
        o, final_state = ops.recurrent(q, k, v, g=g, **opts)
    o = rms_norm(o, params[c.norm_param], c.norm_eps)
    if c.use_output_gate:
        g = linear(x, params["g_proj.weight"]).reshape(*lead, H, V)
        o = o * jax.nn.silu(g)
    o = linear(o.reshape(*lead, H * V), params["o_proj.weight"])
    return (o, final_state) if use_cache else o


def gla_apply(params, x, config: LayerConfig, *, attention_mask=None, cu_seqlens=None,
              state=None, use_cache=False, mode="auto", platform="auto",
              context_axis=None):
    """The GLA layer (module docstring)."""
    return _apply(params, x, config, "gla", attention_mask, cu_seqlens, state, use_cache,
                  mode, platform, context_axis)


def lightning_apply(params, x, config: LayerConfig, *, attention_mask=None, cu_seqlens=None,
                    state=None, use_cache=False, mode="auto", platform="auto",
                    context_axis=None):
    """The Lightning attention layer (module docstring)."""
    return _apply(params, x, config, "lightning", attention_mask, cu_seqlens, state,
                  use_cache, mode, platform, context_axis)
