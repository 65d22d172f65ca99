"""The GLA language model's configuration and parameter table, shared by both frameworks.

`GLAConfig` is a transformers `PreTrainedConfig` (model_type "gla") with
flash-linear-attention 0.6.0's `GLAConfig` fields, names and defaults, so a `config.json`
fla writes reads here and ours reads in fla; both spellings of fla-hub's configs load
(older: `attn_mode: "fused_chunk"`, `rms_norm_eps`, no `norm_eps`; newer: `"chunk"`,
`norm_eps`, `use_output_gate`). Importing this module registers it with transformers'
`AutoConfig` unless something (flash-linear-attention) already holds "gla": see
`register_auto_config`. transformers imports torch when torch is installed; this module
itself uses neither torch nor jax.

The model (fla's structure): token embedding; per block RMSNorm -> GLA attention ->
residual -> RMSNorm -> SwiGLU MLP -> residual; final RMSNorm; lm head (tied to the
embedding when tie_word_embeddings). Parameters, by fla's names (`model_param_shapes`):

    model.embeddings.weight                 [vocab, D]
    model.layers.{i}.attn_norm.weight       [D]
    model.layers.{i}.attn.<layer param>     bridge.weights.param_shapes(config.layer)
    model.layers.{i}.mlp_norm.weight        [D]
    model.layers.{i}.mlp.gate_proj.weight   [I, D]   up_proj.weight [I, D]   down_proj.weight [D, I]
    model.norm.weight                       [D]
    lm_head.weight                          [vocab, D]   (absent when tied)

(D hidden_size, I intermediate; Linear weights are [out, in] as torch stores them.)
"""

import json
import math
from dataclasses import fields

from transformers import AutoConfig, PreTrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from .weights import FEATURE_MAPS, LayerConfig

MODEL_TYPE = "gla"
ARCHITECTURE = "GLAForCausalLM"
ATTN_MODES = ("chunk", "fused_recurrent", "fused_chunk")  # fla's kernel choice: same math
NORM_EPS = 1e-6  # fla's default; old fla-hub configs spell it rms_norm_eps


class GLAConfig(PreTrainedConfig):
    """fla's GLAConfig (same fields and defaults), validated, as a transformers config.

    Supported as fla computes them: hidden_size, expand_k, expand_v, hidden_ratio /
    intermediate_size, num_hidden_layers, num_heads, num_kv_heads, feature_map,
    use_output_gate, clamp_min, norm_eps (or the old rms_norm_eps), tie_word_embeddings,
    vocab_size, pad_token_id (the embedding's padding_idx), initializer_range (init), and
    ours: gate_low_rank_dim / gate_logit_normalizer (fla's model fixes both at 16, so only
    those values load into fla). Accepted and without effect on the math, as in fla:
    attn_mode, conv_size (without short conv), max_position_embeddings, use_gk, use_gv
    (fla 0.6.0's layer reads neither), use_cache, bos/eos_token_id, fuse_swiglu,
    fuse_cross_entropy, fuse_linear_cross_entropy (kernel choices), fuse_norm (the
    output norm's name only). Anything else of fla's is a ValueError naming it:
    use_short_conv=True, attn (hybrid attention layers), attnres_block_size,
    use_l2warp=True, elementwise_affine=False, hidden_act other than "swish". Keys of
    neither (transformers' own, old fla-hub extras) are kept as attributes, as
    transformers does.

    Two configs are equal (and hash alike) when their GLA fields are: transformers'
    bookkeeping (dtype, name_or_path, architectures) does not change the model. The hash
    follows the fields' current values, so a JAX model's compiled functions (which take
    the config as static) see an edited config as a new one."""

    model_type = MODEL_TYPE
    keys_to_ignore_at_inference = ["cache"]

    hidden_size: int = 2048
    expand_k: float = 0.5
    expand_v: float = 1.0
    hidden_ratio: float | None = 4
    intermediate_size: int | None = None
    num_hidden_layers: int = 24
    num_heads: int = 4
    num_kv_heads: int | None = None
    feature_map: str | None = None
    attn_mode: str = "chunk"
    use_short_conv: bool = False
    conv_size: int = 4
    use_output_gate: bool = True
    clamp_min: float | None = None
    hidden_act: str = "swish"
    max_position_embeddings: int = 2048
    elementwise_affine: bool | None = True
    norm_eps: float = NORM_EPS
    use_gk: bool = True
    use_gv: bool = False
    attn: object = None
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = 1
    eos_token_id: int | list | None = 2
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    fuse_norm: bool = True
    fuse_swiglu: bool = True
    fuse_cross_entropy: bool = True
    fuse_linear_cross_entropy: bool = False
    use_l2warp: bool = False
    vocab_size: int = 32000
    attnres_block_size: int | None = None
    # not in fla's GLAConfig: its model builds every layer with its defaults, 16 and 16
    gate_low_rank_dim: int = 16
    gate_logit_normalizer: float = 16

    def __post_init__(self, **kwargs):
        legacy = kwargs.pop("rms_norm_eps", None)  # fla-hub's older spelling of norm_eps
        if legacy is not None:
            if self.norm_eps not in (NORM_EPS, legacy):
                raise ValueError(f"rms_norm_eps: {legacy!r} disagrees with norm_eps="
                                 f"{self.norm_eps!r}; give one of them")
            self.norm_eps = legacy
        self._check()
        super().__post_init__(**kwargs)

    def _check(self):
        unsupported = (
            ("use_short_conv", self.use_short_conv, False),
            ("attn", self.attn, None),
            ("attnres_block_size", self.attnres_block_size, None),
            ("use_l2warp", self.use_l2warp, False),
            ("elementwise_affine", self.elementwise_affine, True),
            ("hidden_act", self.hidden_act, "swish"),
        )
        for name, value, want in unsupported:
            if value != want:
                raise ValueError(f"{name}: gla-bridge's GLA model supports only "
                                 f"{name}={want!r}, got {value!r}")
        if self.attn_mode not in ATTN_MODES:
            raise ValueError(f"attn_mode: expected one of {ATTN_MODES}, got {self.attn_mode!r}")
        if self.fuse_cross_entropy and self.fuse_linear_cross_entropy:
            raise ValueError("fuse_linear_cross_entropy: cannot be True together with "
                             "fuse_cross_entropy (as in fla)")
        for name in ("vocab_size", "num_hidden_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if self.intermediate_size is not None and (
                not isinstance(self.intermediate_size, int) or self.intermediate_size < 1):
            raise ValueError(f"intermediate_size: expected None or a positive int, "
                             f"got {self.intermediate_size!r}")
        if self.hidden_ratio is not None and not (isinstance(self.hidden_ratio, (int, float))
                                                  and self.hidden_ratio > 0):
            raise ValueError(f"hidden_ratio: expected None or > 0, got {self.hidden_ratio!r}")
        if not (isinstance(self.norm_eps, (int, float)) and self.norm_eps > 0):
            raise ValueError(f"norm_eps: expected > 0, got {self.norm_eps!r}")
        if self.pad_token_id is not None and not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(f"pad_token_id: expected None or a token id below vocab_size="
                             f"{self.vocab_size}, got {self.pad_token_id!r}")
        if self.feature_map is not None and self.feature_map not in FEATURE_MAPS:
            raise ValueError(f"feature_map: expected None or one of {FEATURE_MAPS}, "
                             f"got {self.feature_map!r}")
        _ = self.layer  # the attention's own checks (expand_k, num_kv_heads, clamp_min, ...)

    def _key(self) -> tuple:
        return tuple((n, json.dumps(getattr(self, n), sort_keys=True, default=str))
                     for n in GLA_FIELDS)

    def __eq__(self, other):
        return isinstance(other, GLAConfig) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    @property
    def layer_types(self) -> list:
        """Every block holds a recurrent state: transformers' `DynamicCache(config=...)`
        gives each a linear-attention cache layer."""
        return ["linear_attention"] * self.num_hidden_layers

    @property
    def layer(self) -> LayerConfig:
        """Every block's attention layer (the same for all: GLA has no per-layer decay)."""
        return LayerConfig(
            hidden_size=self.hidden_size, num_heads=self.num_heads, kind="gla",
            num_kv_heads=self.num_kv_heads, expand_k=self.expand_k, expand_v=self.expand_v,
            gate_low_rank_dim=self.gate_low_rank_dim,
            gate_logit_normalizer=self.gate_logit_normalizer,
            use_output_gate=self.use_output_gate, norm_eps=self.norm_eps,
            clamp_min=self.clamp_min, feature_map=self.feature_map, fuse_norm=self.fuse_norm)

    @property
    def mlp_size(self) -> int:
        """The SwiGLU MLP's inner width I, as fla's GatedMLP picks it: intermediate_size, or
        2/3 * hidden_ratio (default 4) * hidden_size rounded up to a multiple of 256."""
        if self.intermediate_size is not None:
            return self.intermediate_size
        ratio = 4 if self.hidden_ratio is None else self.hidden_ratio
        size = int(self.hidden_size * ratio * 2 / 3)
        return 256 * math.ceil(size / 256)

    def eos_ids(self) -> tuple:
        """eos_token_id as a tuple (empty when None)."""
        e = self.eos_token_id
        return () if e is None else (e,) if isinstance(e, int) else tuple(e)

    @classmethod
    def from_dict(cls, config_dict, **kwargs) -> "GLAConfig":
        """transformers' from_dict, after checking model_type is "gla" (when present)."""
        if not isinstance(config_dict, dict):
            raise TypeError(f"config_dict: expected a dict, got {type(config_dict).__name__}")
        got = config_dict.get("model_type", MODEL_TYPE)
        if got != MODEL_TYPE:
            raise ValueError(f"model_type: expected {MODEL_TYPE!r}, got {got!r}")
        return super().from_dict(dict(config_dict), **kwargs)

    def to_json(self) -> str:
        """config.json's text as checkpoints carry it: every field (not only those off
        their defaults, so any reader of fla's fields sees the same model), model_type,
        architectures [GLAForCausalLM]."""
        d = self.to_dict()
        d.pop("_name_or_path", None)
        d["architectures"] = [ARCHITECTURE]
        return json.dumps(d, indent=2, sort_keys=True) + "\n"


GLA_FIELDS = tuple(f.name for f in fields(GLAConfig)
                   if f.name not in {b.name for b in fields(PreTrainedConfig)})


def register_auto_config() -> bool:
    """Register GLAConfig with transformers' AutoConfig for model_type "gla", unless
    something holds it already; True when registered. flash-linear-attention registers
    its own GLAConfig (overwriting) whenever `fla` is imported, before or after us, so
    with fla imported the Auto classes give fla's model and without it ours: we never
    replace another library's registration. Our classes load a "gla" directory
    whatever is registered (`GLAForCausalLM.from_pretrained`)."""
    if MODEL_TYPE in CONFIG_MAPPING:
        return CONFIG_MAPPING[MODEL_TYPE] is GLAConfig
    AutoConfig.register(MODEL_TYPE, GLAConfig)
    return True


register_auto_config()


def model_param_shapes(config: GLAConfig) -> dict:
    """{name: shape} of every parameter a checkpoint holds (module docstring), in the
    order of the torch model's state_dict."""
    from .weights import param_shapes

    D, V, I = config.hidden_size, config.vocab_size, config.mlp_size
    shapes = {"model.embeddings.weight": (V, D)}
    attn = param_shapes(config.layer)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "attn_norm.weight"] = (D,)
        shapes.update({p + "attn." + n: s for n, s in attn.items()})
        shapes[p + "mlp_norm.weight"] = (D,)
        shapes.update({p + "mlp.gate_proj.weight": (I, D), p + "mlp.up_proj.weight": (I, D),
                       p + "mlp.down_proj.weight": (D, I)})
    shapes["model.norm.weight"] = (D,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, D)
    return shapes


def init_rule(name: str) -> str:
    """How fla initialises a parameter: "ones" (norm weights), "zeros" (biases) or
    "normal" (Linear and embedding weights: N(0, initializer_range**2))."""
    if name.endswith("norm.weight") or name.endswith("norm_swish_gate.weight"):
        return "ones"
    return "zeros" if name.endswith(".bias") else "normal"
