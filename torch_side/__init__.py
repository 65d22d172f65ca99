"""PyTorch ops and layers of gla-bridge: recurrent / gated linear attention (SPEC.md)."""

from .layers import GatedLinearAttention, LightningAttention
from .ops import recurrent
from .variants import gla_attention, lightning_attn, recurrent_gla
from . import easydel  # EasyDeL's call: torch_side.easydel.recurrent_gla

__all__ = ["recurrent", "recurrent_gla", "lightning_attn", "gla_attention", "easydel",
           "GatedLinearAttention", "LightningAttention"]

from .models import GLAForCausalLM, GLAModel  # noqa: E402  (the language model)

__all__ += ["GLAModel", "GLAForCausalLM"]
