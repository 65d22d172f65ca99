"""The GLA language model in PyTorch, a transformers model: GLAModel and GLAForCausalLM.

flash-linear-attention's GLA model (structure, parameter names, init; bridge/model_config.py):
token embedding; per block RMSNorm -> GatedLinearAttention -> residual -> RMSNorm ->
SwiGLU MLP -> residual; final RMSNorm; lm head (tied to the embedding when
config.tie_word_embeddings). Both are transformers `PreTrainedModel`s (GLAForCausalLM
with `GenerationMixin`), registered with AutoModel / AutoModelForCausalLM for our
GLAConfig (`bridge.model_config.register_auto_config` says who serves "gla"). The
state_dict keys are fla's, so a directory fla writes loads here strictly
(`from_pretrained`, safetensors only) and `save_pretrained`'s loads into fla.

Recurrent state: transformers' own cache. `DynamicCache(config=config)` holds one
linear-attention layer per block (config.layer_types), each one [N, H, K, V] float32
state, updated in place (a static address: torch.compile and CUDA graphs keep it);
`generate` (transformers') runs the prompt as one chunked call per layer, then one
recurrent step per layer for each new token.
"""

import os

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import (AutoModel, AutoModelForCausalLM, DynamicCache, GenerationMixin,
                          PreTrainedModel)
from transformers import initialization as init
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from bridge import checkpoint
from bridge.model_config import GLAConfig, init_rule, model_param_shapes
from .layers import GatedLinearAttention, RMSNorm


class GLAMLP(nn.Module):
    """SwiGLU: down_proj(silu(gate_proj(x)) * up_proj(x)) (fla's GatedMLP)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GLABlock(nn.Module):
    """h + attn(attn_norm(h)), then + mlp(mlp_norm(.)); returns (h, state or None)."""

    def __init__(self, config: GLAConfig, mode="auto", platform="auto"):
        super().__init__()
        D = config.hidden_size
        self.attn_norm = RMSNorm(D, config.norm_eps)
        self.attn = GatedLinearAttention(config=config.layer, mode=mode, platform=platform)
        self.mlp_norm = RMSNorm(D, config.norm_eps)
        self.mlp = GLAMLP(D, config.mlp_size)

    def forward(self, h, attention_mask=None, cu_seqlens=None, state=None, use_cache=False):
        a = self.attn(self.attn_norm(h), attention_mask=attention_mask, cu_seqlens=cu_seqlens,
                      state=state, use_cache=use_cache)
        a, state = a if use_cache else (a, None)
        h = h + a
        return h + self.mlp(self.mlp_norm(h)), state


class GLAPreTrainedModel(PreTrainedModel):
    """What GLAModel and GLAForCausalLM share: the config class, fla's init, and
    `mode` / `platform` (torch_side.ops.recurrent's kernel choice) for every layer."""

    config_class = GLAConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["GLABlock"]
    _is_stateful = True  # a recurrent state cannot be rolled back: no assisted decoding

    def __init__(self, config: GLAConfig, *, mode="auto", platform="auto"):
        if not isinstance(config, GLAConfig):
            raise TypeError(f"config: expected a bridge.model_config.GLAConfig, "
                            f"got {type(config).__name__}")
        super().__init__(config)

    def _init_weights(self, module):
        """fla's init (bridge.model_config.init_rule, by each parameter's name):
        normal(0, initializer_range) Linear and embedding weights, zero biases, unit
        norms."""
        prefix = next(n for n, m in self.named_modules() if m is module)
        std = self.config.initializer_range
        for name, p in module.named_parameters(recurse=False):
            rule = init_rule(f"{prefix}.{name}")
            if rule == "ones":
                init.ones_(p)
            elif rule == "zeros":
                init.zeros_(p)
            else:
                init.normal_(p, mean=0.0, std=std)


class GLAModel(GLAPreTrainedModel):
    """Embedding, blocks, final norm.

    forward(input_ids [B, T] (or [1, total] with cu_seqlens [N+1]), attention_mask [B, T]
    (1 = token, 0 = left padding), inputs_embeds [B, T, D] instead of input_ids, cache (a
    transformers Cache holding the states of earlier calls; one is made when use_cache
    and none is given), use_cache (default config.use_cache, False in training)) ->
    BaseModelOutputWithPast(last_hidden_state [B, T, D], cache)."""

    def __init__(self, config: GLAConfig, *, mode="auto", platform="auto"):
        super().__init__(config, mode=mode, platform=platform)
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size,
                                       padding_idx=config.pad_token_id)
        self.layers = nn.ModuleList(GLABlock(config, mode, platform)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.post_init()

    def get_input_embeddings(self):
        return self.embeddings

    def set_input_embeddings(self, value):
        self.embeddings = value

    def embed(self, input_ids):
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or (
                input_ids.dtype.is_floating_point or input_ids.dtype.is_complex):
            raise ValueError(f"input_ids: expected an integer tensor [B, T], got "
                             f"{getattr(input_ids, 'dtype', type(input_ids).__name__)} "
                             f"{tuple(getattr(input_ids, 'shape', ()))}")
        V = self.config.vocab_size
        if not torch.compiler.is_compiling() and input_ids.numel() and (
                int(input_ids.min()) < 0 or int(input_ids.max()) >= V):
            raise ValueError(f"input_ids: expected token ids in [0, vocab_size={V}), got "
                             f"[{int(input_ids.min())}, {int(input_ids.max())}]")
        return self.embeddings(input_ids)

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, cache=None,
                use_cache=None, cu_seqlens=None, output_hidden_states=None, **kwargs):
        """(transformers' other keywords, such as position_ids or return_dict, are
        accepted and unused: GLA has no positions and always returns a ModelOutput.)"""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("input_ids: give exactly one of input_ids and inputs_embeds")
        if use_cache is None:
            use_cache = self.config.use_cache and not self.training
        if cache is not None and not hasattr(cache, "update_recurrent_state"):
            raise TypeError(f"cache: expected a transformers Cache (DynamicCache(config=...)), "
                            f"got {type(cache).__name__}")
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        h = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        hidden = [h] if output_hidden_states else None
        for i, layer in enumerate(self.layers):
            state = None if cache is None else cache.get_recurrent_state(i)
            h, state = layer(h, attention_mask, cu_seqlens, state, cache is not None)
            if cache is not None:
                cache.update_recurrent_state(state, i)
                # no conv state marks the layer as started: the recurrent state does
                cache.layers[i].has_previous_state[0] = True
            if hidden is not None:
                hidden.append(h)
        h = self.norm(h)
        if hidden is not None:
            hidden[-1] = h
        return BaseModelOutputWithPast(last_hidden_state=h, cache=cache if use_cache else None,
                                       hidden_states=None if hidden is None else tuple(hidden))


def _to_torch(a):
    """A NumPy array (ml_dtypes bfloat16 included) as a tensor, without a copy."""
    if a.dtype.name == "bfloat16":  # torch cannot take ml_dtypes' bf16 directly
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))


def _to_numpy(t):
    """A CPU copy of a tensor as a NumPy array (bfloat16 as ml_dtypes.bfloat16)."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


class GLAForCausalLM(GLAPreTrainedModel, GenerationMixin):
    """GLAModel and the lm head (fla's GLAForCausalLM), a transformers causal LM:
    `generate` is transformers' (greedy, sampling, beam search, logits processors,
    streamers, stopping criteria), its recurrent states in transformers' cache.
    Parameters initialised as fla does from torch's global RNG.

    forward(input_ids, attention_mask=None, inputs_embeds=None, cache=None,
    use_cache=None, labels=None, logits_to_keep=0, cu_seqlens=None) ->
    CausalLMOutputWithPast(loss (fla's next-token cross-entropy, when labels are given),
    logits [B, T, vocab] (the last logits_to_keep positions when > 0), cache)."""

    _tied_weights_keys = {"lm_head.weight": "model.embeddings.weight"}

    def __init__(self, config: GLAConfig, *, mode="auto", platform="auto"):
        super().__init__(config, mode=mode, platform=platform)
        self.model = GLAModel(config, mode=mode, platform=platform)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embeddings

    def set_input_embeddings(self, value):
        self.model.embeddings = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def prepare_inputs_for_generation(self, input_ids, cache=None, attention_mask=None,
                                      is_first_iteration=False, **kwargs):
        inputs = super().prepare_inputs_for_generation(
            input_ids, cache=cache, attention_mask=attention_mask,
            is_first_iteration=is_first_iteration, **kwargs)
        if cache is not None and not is_first_iteration and kwargs.get("use_cache", True):
            # after the prompt the state holds the padding's absence; new tokens are real
            inputs["attention_mask"] = None
        return inputs

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, cache=None,
                use_cache=None, labels=None, logits_to_keep=0, cu_seqlens=None,
                output_hidden_states=None, **kwargs):
        out = self.model(input_ids, attention_mask, inputs_embeds, cache, use_cache,
                         cu_seqlens, output_hidden_states)
        h = out.last_hidden_state
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        logits = self.lm_head(h)
        loss = None if labels is None else causal_lm_loss(logits, labels)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=out.cache,
                                      hidden_states=out.hidden_states)

    def loss(self, input_ids, labels=None, attention_mask=None, cu_seqlens=None):
        """Mean next-token cross-entropy as fla computes it: position t predicts labels
        (default input_ids) at t+1; the last position and labels of -100 are ignored
        (packed with cu_seqlens: set each sequence's first label to -100, or its
        predecessor learns across the boundary)."""
        logits = self(input_ids, attention_mask, cu_seqlens=cu_seqlens, use_cache=False).logits
        return causal_lm_loss(logits, input_ids if labels is None else labels)

    # ---------------------------------------------------------------- checkpoints
    def params(self) -> dict:
        """{name: tensor} of the checkpoint's parameters (model_param_shapes names: no
        lm_head.weight when tied)."""
        state = self.state_dict()
        return {name: state[name] for name in model_param_shapes(self.config)}

    def load_params(self, params: dict) -> None:
        """Copy `params` ({name: tensor or NumPy array}) into the model in place, strictly
        (bridge.checkpoint.check_model_params: ValueError before anything is written)."""
        checkpoint.check_model_params(params, self.config)
        state = self.state_dict()
        with torch.no_grad():
            for name, src in params.items():
                src = src if isinstance(src, torch.Tensor) else _to_torch(src)
                state[name].copy_(src)

    @classmethod
    def from_pretrained(cls, path, *args, config=None, dtype=None, mode="auto",
                        platform="auto", **kwargs):
        """Load a local directory fla or `save_pretrained` wrote (config.json,
        model.safetensors or the sharded index), strictly, never pickle; whatever
        transformers' Auto classes have registered for "gla". `config`: a GLAConfig to
        use instead of the directory's. `dtype` (a torch dtype, its name, or "auto"):
        the parameters' dtype; by default the checkpoint's own (float32 when its
        arrays mix dtypes). transformers' download options (revision, cache_dir, ...)
        are accepted and unused: nothing is downloaded."""
        dtype = kwargs.pop("torch_dtype", dtype)
        unknown = sorted(set(kwargs) - _HUB_KWARGS) + (["args"] if args else [])
        if kwargs.get("use_safetensors") is False:
            unknown.append("use_safetensors=False")
        if unknown:
            raise TypeError(f"from_pretrained: unsupported arguments {unknown} (gla-bridge "
                            f"loads local safetensors directories)")
        if not os.path.isdir(os.fspath(path)):
            raise ValueError(f"path: {os.fspath(path)!r} is not a local directory (nothing "
                             f"is downloaded: give the directory of a checkpoint)")
        own, params = checkpoint.load_pretrained(path)
        if config is None:
            config = own
        elif not isinstance(config, GLAConfig) or config != own:
            raise ValueError(f"config: expected the directory's GLAConfig, got {config}")
        if dtype is None or dtype == "auto":
            dtypes = {_to_torch(a[:0]).dtype for a in params.values()}
            dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
        elif isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        model = cls(config, mode=mode, platform=platform).to(dtype)
        model.load_params(params)
        model.config.name_or_path = os.fspath(path)
        return model.eval()

    def save_pretrained(self, path, *, max_shard_size=None, safe_serialization=True) -> None:
        """Write config.json and model.safetensors (or shards of at most max_shard_size,
        bytes or '5GB', with model.safetensors.index.json) under fla's names."""
        if not safe_serialization:
            raise ValueError("safe_serialization: gla-bridge writes safetensors only")
        params = {n: _to_numpy(t) for n, t in self.params().items()}
        checkpoint.save_pretrained(os.fspath(path), self.config, params,
                                   max_shard_size=max_shard_size)


# transformers' Auto classes pass these to from_pretrained: about downloading, unused here
_HUB_KWARGS = {"cache_dir", "force_download", "local_files_only", "proxies", "revision",
               "subfolder", "token", "trust_remote_code", "adapter_kwargs", "_from_auto",
               "code_revision", "use_safetensors", "low_cpu_mem_usage", "_commit_hash"}


def causal_lm_loss(logits, labels):
    """Mean cross-entropy of logits [B, T, vocab] at t against labels [B, T] at t+1 (fla's
    shift: the last position and labels of -100 are ignored), in float32."""
    shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], 1)
    return F.cross_entropy(logits.flatten(0, 1).float(), shifted.flatten(), ignore_index=-100)


# our config class -> our models, whoever serves model_type "gla" (model_config)
AutoModel.register(GLAConfig, GLAModel, exist_ok=True)
AutoModelForCausalLM.register(GLAConfig, GLAForCausalLM, exist_ok=True)
