"""JAX ops and layers of gla-bridge: recurrent / gated linear attention (SPEC.md)."""

from .layers import gla_apply, init_gla, init_lightning, lightning_apply
from .ops import recurrent
from .variants import gla_attention, lightning_attn, recurrent_gla
from . import easydel  # EasyDeL's call: jax_side.easydel.recurrent_gla

__all__ = ["recurrent", "recurrent_gla", "lightning_attn", "gla_attention", "easydel",
           "init_gla", "gla_apply", "init_lightning", "lightning_apply"]


def __getattr__(name):
    # the language model (jax_side.models; GLAConfig is bridge.model_config's, shared with
    # torch_side) needs flax and transformers, the `models` extra; the ops do not
    if name in ("GLAConfig", "GLAModel", "GLAForCausalLM"):
        from . import models

        return getattr(models, name)
    raise AttributeError(f"module 'jax_side' has no attribute {name!r}")
