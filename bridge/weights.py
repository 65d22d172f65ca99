"""The layer configuration shared by both frameworks, and weight transfer through DLPack.

A layer's parameters are named as the PyTorch module's `state_dict` keys and kept in
PyTorch's layout on both sides (a Linear weight is [out, in]; the JAX apply computes
`x @ W.T`), so moving weights is a per-array DLPack hand-over, never a reshuffle.

    q_proj.weight      [H*K, D]              k_proj.weight  [Hk*K, D]   v_proj.weight [Hk*V, D]
    gk_proj.0.weight   [R, D]   (GLA)        gk_proj.1.weight [Hk*K, R]  gk_proj.1.bias [Hk*K]
    g_proj.weight      [H*V, D] (output gate)  g_norm.weight [V]        o_proj.weight [D, H*V]

(D hidden_size, H num_heads, Hk num_kv_heads, K/V per-head key/value dims, R gate_low_rank_dim.)
The output norm is named `g_norm_swish_gate.weight` instead when config.fuse_norm and
config.use_output_gate (fla's name for it; `LayerConfig.norm_param`).
torch and jax are imported lazily so that either side can use the config alone.
"""

from dataclasses import dataclass

KINDS = ("gla", "lightning")
# fla's feature maps for q and k (its ACT2FN names; "gelu" is the tanh approximation)
FEATURE_MAPS = ("relu", "sigmoid", "logsigmoid", "swish", "silu", "sqrelu", "gelu")


@dataclass(frozen=True)
class LayerConfig:
    """Hyper-parameters of a GatedLinearAttention ("gla") or LightningAttention layer.

    Defaults follow flash-linear-attention's GLA layer: key dim = expand_k * hidden,
    value dim = expand_v * hidden, gate = max(logsigmoid(W2 W1 x + b) / gate_logit_normalizer,
    clamp_min); q and k go through `feature_map` (one of FEATURE_MAPS) when given.
    `fuse_norm` changes no math, only the output norm's name (`norm_param`): fla fuses the
    norm with the swish output gate and calls it `g_norm_swish_gate`. fla's layer defaults
    to fuse_norm=True; ours to False, the name the layer had before the model existed
    (the model sets it from GLAConfig.fuse_norm).
    Frozen and hashable, so a JAX apply can take it as a static argument."""

    hidden_size: int
    num_heads: int
    kind: str = "gla"
    num_kv_heads: int | None = None
    expand_k: float = 0.5
    expand_v: float = 1.0
    gate_low_rank_dim: int = 16
    gate_logit_normalizer: float = 16.0
    use_output_gate: bool = True
    norm_eps: float = 1e-5
    clamp_min: float | None = None
    feature_map: str | None = None
    fuse_norm: bool = False
    layer_idx: int = 0       # lightning only: picks the constant decay
    num_layers: int = 1      # lightning only

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind: expected one of {KINDS}, got {self.kind!r}")
        for name in ("hidden_size", "num_heads", "gate_low_rank_dim", "num_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if self.num_kv_heads is not None and (
                not isinstance(self.num_kv_heads, int) or self.num_kv_heads < 1
                or self.num_heads % self.num_kv_heads):
            raise ValueError(f"num_kv_heads: expected a positive divisor of num_heads="
                             f"{self.num_heads}, got {self.num_kv_heads!r}")
        for name, dim in (("expand_k", self.key_dim), ("expand_v", self.value_dim)):
            if dim < 1 or dim % self.num_heads or dim != getattr(self, name) * self.hidden_size:
                raise ValueError(f"{name}: {name} * hidden_size must be a positive integer "
                                 f"multiple of num_heads={self.num_heads}, got "
                                 f"{getattr(self, name)} * {self.hidden_size}")
        if not self.gate_logit_normalizer > 0:
            raise ValueError(f"gate_logit_normalizer: expected > 0, "
                             f"got {self.gate_logit_normalizer!r}")
        if self.clamp_min is not None and not (isinstance(self.clamp_min, (int, float))
                                               and -float("inf") < self.clamp_min <= 0):
            raise ValueError(f"clamp_min: expected None or a finite log-decay <= 0, "
                             f"got {self.clamp_min!r}")
        if self.feature_map is not None and self.feature_map not in FEATURE_MAPS:
            raise ValueError(f"feature_map: expected None or one of {FEATURE_MAPS}, "
                             f"got {self.feature_map!r}")
        if not 0 <= self.layer_idx < self.num_layers:
            raise ValueError(f"layer_idx: expected 0 <= layer_idx < num_layers="
                             f"{self.num_layers}, got {self.layer_idx!r}")

    @property
    def norm_param(self) -> str:
        """The output norm's weight name (see the class docstring)."""
        fused = self.fuse_norm and self.use_output_gate
        return "g_norm_swish_gate.weight" if fused else "g_norm.weight"

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def key_dim(self) -> int:
        return int(self.hidden_size * self.expand_k)

    @property
    def value_dim(self) -> int:
        return int(self.hidden_size * self.expand_v)

    @property
    def head_k_dim(self) -> int:
        return self.key_dim // self.num_heads

    @property
    def head_v_dim(self) -> int:
        return self.value_dim // self.num_heads

    def state_shape(self, n: int) -> tuple:
        """The recurrent state of n sequences: [N, H, K, V] float32."""
        return (n, self.num_heads, self.head_k_dim, self.head_v_dim)


def param_shapes(config: LayerConfig) -> dict:
    """{name: shape} of every parameter, in the PyTorch module's state_dict order."""
    D, Hk = config.hidden_size, config.kv_heads
    K, V = config.head_k_dim, config.head_v_dim
    shapes = {"q_proj.weight": (config.key_dim, D), "k_proj.weight": (Hk * K, D),
              "v_proj.weight": (Hk * V, D)}
    if config.kind == "gla":
        R = config.gate_low_rank_dim
        shapes.update({"gk_proj.0.weight": (R, D), "gk_proj.1.weight": (Hk * K, R),
                       "gk_proj.1.bias": (Hk * K,)})
    if config.use_output_gate:
        shapes["g_proj.weight"] = (config.value_dim, D)
    shapes.update({config.norm_param: (V,), "o_proj.weight": (D, config.value_dim)})
    return shapes


def check_params(params, config: LayerConfig, argname: str = "params") -> None:
    """ValueError unless `params` has exactly the names and shapes `config` asks for."""
    if not isinstance(params, dict):
        raise TypeError(f"{argname}: expected a dict of arrays, got {type(params).__name__}")
    want = param_shapes(config)
    missing, extra = sorted(set(want) - set(params)), sorted(set(params) - set(want))
    if missing or extra:
        raise ValueError(f"{argname}: names do not fit the config (missing {missing}, "
                         f"unexpected {extra}); config {config}")
    for name, shape in want.items():
        got = tuple(params[name].shape)
        if got != shape:
            raise ValueError(f"{argname}[{name!r}]: expected shape {shape} for config "
                             f"{config}, got {got}")


def check_inputs(config: LayerConfig, x, attention_mask=None, cu_seqlens=None,
                 state=None) -> None:
    """ValueError naming the argument unless a layer call's inputs fit `config`:
    x [B, T, hidden_size]; attention_mask [B, T] (not with cu_seqlens); state
    [N, H, K, V]. Both frameworks' layers call this."""
    c = config
    shape = getattr(x, "shape", None)
    if shape is None or len(shape) != 3 or shape[-1] != c.hidden_size:
        raise ValueError(f"x: expected an array [B, T, {c.hidden_size}], got "
                         f"{tuple(shape) if shape is not None else type(x).__name__}")
    if attention_mask is not None:
        if cu_seqlens is not None:
            raise ValueError("attention_mask: give either attention_mask or cu_seqlens, not both")
        if tuple(attention_mask.shape) != tuple(shape[:2]):
            raise ValueError(f"attention_mask: expected shape [B, T] = {tuple(shape[:2])}, "
                             f"got {tuple(attention_mask.shape)}")
    H, K, V = c.num_heads, c.head_k_dim, c.head_v_dim
    if state is not None and (len(state.shape) != 4 or tuple(state.shape[1:]) != (H, K, V)):
        raise ValueError(f"state: expected shape [N, H={H}, K={K}, V={V}], "
                         f"got {tuple(state.shape)}")


def _module_config(module, argname="module"):
    config = getattr(module, "config", None)
    if not isinstance(config, LayerConfig):
        raise TypeError(f"{argname}: expected a gla-bridge layer with a LayerConfig `config`, "
                        f"got {type(module).__name__}")
    return config


def params_from_torch(module, config: LayerConfig | None = None, *, copy: bool = False) -> dict:
    """The module's parameters as a dict of jax arrays (names of `param_shapes`).

    Zero-copy by default: the jax arrays alias the torch storage (DLPack), so an in-place
    torch update (an optimizer step) shows up in them; pass copy=True for a snapshot.
    A tensor that is not 64-byte aligned is copied by jax silently. `config`, if given,
    must equal the module's (ValueError otherwise)."""
    import jax
    import jax.numpy as jnp

    own = _module_config(module)
    if config is not None and config != own:
        raise ValueError(f"config: expected the module's config {own}, got {config}")
    state = module.state_dict(keep_vars=True)
    check_params(state, own, "module")
    out = {}
    for name in param_shapes(own):
        t = state[name].detach()  # DLPack refuses tensors that require grad
        if not t.is_contiguous():
            t = t.contiguous()
        arr = jax.dlpack.from_dlpack(t)
        out[name] = jnp.array(arr, copy=True) if copy else arr
    return out


def load_into_torch(module, params: dict, config: LayerConfig | None = None) -> None:
    """Copy `params` (jax or numpy arrays, or tensors) into the module's parameters in place.

    One copy per array, into the existing Parameters, so optimizers and hooks that hold
    them stay valid (aliasing a jax buffer as a trainable Parameter would let torch write
    into an immutable jax array). ValueError on a config, name or shape mismatch,
    before anything is written."""
    import numpy as np
    import torch

    own = _module_config(module)
    if config is not None and config != own:
        raise ValueError(f"config: expected the module's config {own}, got {config}")
    check_params(params, own)
    state = module.state_dict(keep_vars=True)
    sources = {}
    for name in param_shapes(own):
        x = params[name]
        if isinstance(x, torch.Tensor):
            src = x.detach()
        elif isinstance(x, np.ndarray):
            src = torch.from_numpy(np.ascontiguousarray(x))
        else:
            src = torch.from_dlpack(x)  # zero-copy view of the jax buffer; copied below
        if not src.is_floating_point():
            raise TypeError(f"params[{name!r}]: expected a floating dtype, got {src.dtype}")
        sources[name] = src
    with torch.no_grad():
        for name, src in sources.items():
            state[name].copy_(src.to(state[name].device))
