"""PyTorch layers over the public ops: GatedLinearAttention and LightningAttention.

Conventions follow the GLA paper / flash-linear-attention's GLA layer (own code):
q = x Wq, k = x Wk, v = x Wv (k, v on num_kv_heads heads), q and k through the feature
map when config.feature_map, data-dependent key gate
gk = max(logsigmoid(W2 W1 x + b) / gate_logit_normalizer, clamp_min) (GLA only; Lightning
uses the constant per-head decay of `lightning_attn`), o = recurrence, then per-head
RMSNorm, times swish(x Wg) when use_output_gate, then o_proj. Parameter names are fla's
(bridge.weights; the norm is `g_norm_swish_gate` when config.fuse_norm).

forward(x [B,T,D], attention_mask [B,T] (1 = token, 0 = padding), cu_seqlens [N+1]
(x packed as [1,total,D]), state [N,H,K,V], use_cache) returns o [B,T,D], or
(o, state [N,H,K,V] float32) when use_cache. Padded positions get zero k, v, q and a zero
log-gate (no decay), so the state passes them unchanged and their outputs are zero.

With `context_group=` (a torch.distributed ProcessGroup, given to the constructor), x is
this rank's slice of the time axis and the recurrence runs context-parallel over the group
(cu_seqlens: the global offsets; the state the same on every rank).

Both layers compile with torch.compile(fullgraph=True) and export with torch.export: the
recurrence is one custom op (see torch_side/custom_ops.py for its autocast policy).
"""

import torch
import torch.nn.functional as F
from torch import nn

from bridge import variants
from bridge.weights import LayerConfig, check_inputs
from . import ops


# fla's feature maps (bridge.weights.FEATURE_MAPS); "gelu" is its tanh approximation
FEATURE_MAPS = {
    "relu": F.relu, "sigmoid": torch.sigmoid, "logsigmoid": F.logsigmoid, "swish": F.silu,
    "silu": F.silu, "sqrelu": lambda x: F.relu(x).square(),
    "gelu": lambda x: F.gelu(x, approximate="tanh"),
}


class RMSNorm(nn.Module):
    """RMSNorm over the last dim (a head's V, or the model's hidden size), computed in
    float32, returned in x's dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


class _Layer(nn.Module):
    """Shared projections, output gate/norm and the call into the op."""

    KIND = None

    def __init__(self, hidden_size=None, num_heads=4, *, config=None, mode="auto",
                 platform="auto", context_group=None, **kwargs):
        super().__init__()
        if config is None:
            if hidden_size is None:
                raise ValueError("hidden_size: required when no config is given")
            config = LayerConfig(hidden_size=hidden_size, num_heads=num_heads, kind=self.KIND,
                                 **kwargs)
        elif kwargs or hidden_size is not None:
            raise ValueError("config: give either a config or keyword hyper-parameters")
        if config.kind != self.KIND:
            raise ValueError(f"config: expected kind={self.KIND!r}, got {config.kind!r}")
        self.config, self.mode, self.platform = config, mode, platform
        self.context_group = context_group
        c, D = config, config.hidden_size
        Hk = c.kv_heads
        self.q_proj = nn.Linear(D, c.key_dim, bias=False)
        self.k_proj = nn.Linear(D, Hk * c.head_k_dim, bias=False)
        self.v_proj = nn.Linear(D, Hk * c.head_v_dim, bias=False)
        if c.kind == "gla":
            self.gk_proj = nn.Sequential(nn.Linear(D, c.gate_low_rank_dim, bias=False),
                                         nn.Linear(c.gate_low_rank_dim, Hk * c.head_k_dim))
        if c.use_output_gate:
            self.g_proj = nn.Linear(D, c.value_dim, bias=False)
        # fla's name for the norm depends on whether it fuses it with the gate
        self.norm_name = c.norm_param.removesuffix(".weight")
        self.add_module(self.norm_name, RMSNorm(c.head_v_dim, c.norm_eps))
        self.o_proj = nn.Linear(c.value_dim, D, bias=False)

    def _heads(self, t, heads, dim):
        return t.reshape(*t.shape[:-1], heads, dim)

    def _recurrence(self, q, k, v, gk, mask, cu_seqlens, state):
        raise NotImplementedError

    def forward(self, x, attention_mask=None, cu_seqlens=None, state=None, use_cache=False):
        c = self.config
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
        check_inputs(c, x, attention_mask, cu_seqlens, state)
        H, Hk, K, V = c.num_heads, c.kv_heads, c.head_k_dim, c.head_v_dim
        q = self._heads(self.q_proj(x), H, K)
        k = self._heads(self.k_proj(x), Hk, K)
        v = self._heads(self.v_proj(x), Hk, V)
        if c.feature_map is not None:  # before the mask: padding keeps q = k = 0
            # (a map may send 0 elsewhere), so its outputs stay zero
            q, k = (FEATURE_MAPS[c.feature_map](t) for t in (q, k))
        gk = None
        if c.kind == "gla":
            # float32 gates: log-decays summed over many steps lose too much in bf16
            gk = F.logsigmoid(self.gk_proj(x).float()) / c.gate_logit_normalizer
            if c.clamp_min is not None:
                gk = gk.clamp_min(c.clamp_min)
            gk = self._heads(gk, Hk, K)
            if H != Hk:  # head h <- kv head h // G
                gk = gk.repeat_interleave(H // Hk, dim=2)
        mask = None
        if attention_mask is not None:
            mask = attention_mask.to(torch.bool)[..., None, None]
            q, k, v = (t.masked_fill(~mask, 0) for t in (q, k, v))
            if gk is not None:
                gk = gk.masked_fill(~mask, 0)
        # one gla_bridge::fwd op (torch_side/custom_ops.py): no graph break under
        # torch.compile; under autocast it runs q, k, v in the autocast dtype and gates and
        # states in float32
        o, final_state = self._recurrence(q, k, v, gk, mask, cu_seqlens, state)
        o = getattr(self, self.norm_name)(o)
        if c.use_output_gate:
            g = self._heads(self.g_proj(x), H, V)
            o = o * F.silu(g)
        o = self.o_proj(o.reshape(*o.shape[:-2], H * V))
        return (o, final_state) if use_cache else o


class GatedLinearAttention(_Layer):
    """GLA layer (see module docstring). Keyword hyper-parameters as `LayerConfig`
    (hidden_size, num_heads, num_kv_heads, expand_k, expand_v, gate_low_rank_dim,
    gate_logit_normalizer, use_output_gate, norm_eps) or `config=LayerConfig(...)`;
    `mode` / `platform` / `context_group` go to `ops.recurrent` (as
    `variants.recurrent_gla`: `g` the key-dim gate)."""

    KIND = "gla"

    def _recurrence(self, q, k, v, gk, mask, cu_seqlens, state):
        # variants.recurrent_gla's call, one call level less a decoding step
        return ops.recurrent(q, k, v, g=gk, initial_state=state, cu_seqlens=cu_seqlens,
                             mode=self.mode, platform=self.platform,
                             context_group=self.context_group)


class LightningAttention(_Layer):
    """Lightning attention layer: projections + `variants.lightning_attn` (constant per-head
    decay set by config.layer_idx / config.num_layers), same output gate/norm as GLA."""

    KIND = "lightning"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        c = self.config
        # lightning_attn's decay, as Python floats (exact for its float32 values), so that
        # torch.compile traces a constant instead of NumPy code
        self._gamma = variants.lightning_g_gamma(c.num_heads, c.layer_idx,
                                                 c.num_layers).tolist()
        self._gamma_cache = {}

    def _gamma_on(self, device):
        """The decay as a float32 [H] tensor on `device`, made once per device: building it
        per call is a blocking host-to-device copy on CUDA."""
        if torch.compiler.is_compiling():  # a traced constant
            return torch.tensor(self._gamma, dtype=torch.float32, device=device)
        cached = self._gamma_cache.get(device)
        if cached is None:
            cached = self._gamma_cache[device] = torch.tensor(self._gamma, dtype=torch.float32,
                                                              device=device)
        return cached

    def _recurrence(self, q, k, v, gk, mask, cu_seqlens, state):
        gamma = self._gamma_on(q.device)
        if mask is None:  # = variants.lightning_attn
            return ops.recurrent(q, k, v, g_gamma=gamma, initial_state=state,
                                 cu_seqlens=cu_seqlens, mode=self.mode, platform=self.platform,
                                 context_group=self.context_group)
        # padding must not decay the state: the same decay as a per-head, per-step gate,
        # zeroed at padded positions
        g = torch.where(mask[..., 0], gamma, torch.zeros((), device=q.device))
        return ops.recurrent(q, k, v, g=g, initial_state=state, mode=self.mode,
                             platform=self.platform, context_group=self.context_group)
