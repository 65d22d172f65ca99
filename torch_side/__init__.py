"""PyTorch ops and layers of gla-bridge: recurrent / gated linear attention (SPEC.md)."""

import importlib.util

from .layers import GatedLinearAttention, LightningAttention
from .ops import recurrent
from .variants import gla_attention, lightning_attn, recurrent_gla
from . import easydel  # EasyDeL's call: torch_side.easydel.recurrent_gla

__all__ = ["recurrent", "recurrent_gla", "lightning_attn", "gla_attention", "easydel",
           "GatedLinearAttention", "LightningAttention"]

MODEL_NAMES = ("GLAConfig", "GLAModel", "GLAForCausalLM")
if importlib.util.find_spec("transformers") is not None:
    # the language model is a transformers model; importing it registers it with the Auto
    # classes (bridge.model_config.register_auto_config)
    from bridge.model_config import GLAConfig  # noqa: E402
    from .models import GLAForCausalLM, GLAModel  # noqa: E402

    __all__ += ["GLAConfig", "GLAModel", "GLAForCausalLM"]
else:
    def __getattr__(name):
        if name in MODEL_NAMES:
            raise ImportError(f"torch_side.{name}: the GLA language model needs transformers "
                              f"(pip install 'gla-bridge[models]')")
        raise AttributeError(f"module 'torch_side' has no attribute {name!r}")
