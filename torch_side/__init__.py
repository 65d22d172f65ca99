"""PyTorch ops and layers of gla-bridge: recurrent / gated linear attention (SPEC.md)."""

from .layers import GatedLinearAttention, LightningAttention
from .ops import recurrent
from .variants import gla_attention, lightning_attn, recurrent_gla
from . import easydel  # EasyDeL's call: torch_side.easydel.recurrent_gla

__all__ = ["recurrent", "recurrent_gla", "lightning_attn", "gla_attention", "easydel",
           "GatedLinearAttention", "LightningAttention"]

try:
    # the language model is a transformers model; importing it registers it with the Auto
    # classes (bridge.model_config.register_auto_config)
    from bridge.model_config import GLAConfig
    from .models import GLAForCausalLM, GLAModel

    __all__ += ["GLAConfig", "GLAModel", "GLAForCausalLM"]
except ModuleNotFoundError as e:  # the ops and layers need no transformers
    if e.name != "transformers":
        raise
    _missing = e

    def __getattr__(name):
        if name in ("GLAConfig", "GLAModel", "GLAForCausalLM"):
            raise ImportError(f"torch_side.{name}: the GLA language model needs transformers "
                              f"(pip install 'gla-bridge[models]')") from _missing
        raise AttributeError(f"module 'torch_side' has no attribute {name!r}")
