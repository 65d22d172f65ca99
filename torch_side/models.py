"""The GLA language model in PyTorch: GLAModel and GLAForCausalLM.

flash-linear-attention's GLA model (structure, parameter names, init; bridge/model_config.py):
token embedding; per block RMSNorm -> GatedLinearAttention -> residual -> RMSNorm ->
SwiGLU MLP -> residual; final RMSNorm; lm head (tied to the embedding when
config.tie_word_embeddings). The state_dict keys are fla's, so a directory fla writes
loads here strictly (`from_pretrained`) and `save_pretrained`'s loads into fla.

Recurrent state: `states` is a list with one [N, H, K, V] float32 state per layer (all a
GLA model carries between calls). `generate` runs the prompt as one chunked call per
layer, then one recurrent step per layer for each new token.
"""

import os

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from bridge import checkpoint
from bridge.model_config import (GLAConfig, check_prompt_offsets, generate_options, init_rule,
                                 model_param_shapes)
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


def _config(config, kwargs):
    if config is None:
        return GLAConfig(**kwargs)
    if kwargs:
        raise ValueError(f"config: give either a GLAConfig or keyword fields, not both "
                         f"(got {sorted(kwargs)})")
    if not isinstance(config, GLAConfig):
        raise TypeError(f"config: expected a bridge.model_config.GLAConfig, "
                        f"got {type(config).__name__}")
    return config


class GLAModel(nn.Module):
    """Embedding, blocks, final norm. `config` (GLAConfig) or its fields as keywords;
    `mode` / `platform` go to every attention layer (torch_side.ops.recurrent).

    forward(input_ids [B, T] (or [1, total] with cu_seqlens [N+1]), attention_mask [B, T]
    (1 = token, 0 = padding), states (list of [N, H, K, V], one per layer), use_cache,
    inputs_embeds [B, T, D] instead of input_ids) -> hidden [B, T, D], or
    (hidden, states) when use_cache."""

    def __init__(self, config: GLAConfig | None = None, *, mode="auto", platform="auto",
                 **kwargs):
        super().__init__()
        self.config = config = _config(config, kwargs)
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size,
                                       padding_idx=config.pad_token_id)
        self.layers = nn.ModuleList(GLABlock(config, mode, platform)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)

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

    def forward(self, input_ids=None, attention_mask=None, cu_seqlens=None, states=None,
                use_cache=False, inputs_embeds=None):
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("input_ids: give exactly one of input_ids and inputs_embeds")
        h = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        L = len(self.layers)
        if states is not None and (not isinstance(states, (list, tuple)) or len(states) != L):
            raise ValueError(f"states: expected a list of {L} per-layer states [N, H, K, V], "
                             f"got {type(states).__name__} of "
                             f"{len(states) if isinstance(states, (list, tuple)) else '?'}")
        out = []
        for i, layer in enumerate(self.layers):
            h, s = layer(h, attention_mask, cu_seqlens,
                         None if states is None else states[i], use_cache)
            out.append(s)
        h = self.norm(h)
        return (h, out) if use_cache else h


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


class GLAForCausalLM(nn.Module):
    """GLAModel and the lm head (fla's GLAForCausalLM). Parameters initialised as fla
    does (normal(0, initializer_range) for Linear and embedding weights, zero biases,
    unit norms), from torch's global RNG.

    forward(input_ids, attention_mask=None, cu_seqlens=None, states=None, use_cache=False,
    inputs_embeds=None) -> logits [B, T, vocab], or (logits, states) when use_cache."""

    def __init__(self, config: GLAConfig | None = None, *, mode="auto", platform="auto",
                 **kwargs):
        super().__init__()
        self.config = config = _config(config, kwargs)
        self.model = GLAModel(config, mode=mode, platform=platform)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embeddings.weight
        self.reset_parameters()

    def reset_parameters(self):
        """fla's init (bridge.model_config.init_rule)."""
        std = self.config.initializer_range
        with torch.no_grad():
            for name, p in self.named_parameters():
                rule = init_rule(name)
                if rule == "ones":
                    p.fill_(1.0)
                elif rule == "zeros":
                    p.zero_()
                else:
                    p.normal_(0.0, std)

    def forward(self, input_ids=None, attention_mask=None, cu_seqlens=None, states=None,
                use_cache=False, inputs_embeds=None):
        out = self.model(input_ids, attention_mask, cu_seqlens, states, use_cache,
                         inputs_embeds)
        h, states = out if use_cache else (out, None)
        logits = self.lm_head(h)
        return (logits, states) if use_cache else logits

    def loss(self, input_ids, labels=None, attention_mask=None, cu_seqlens=None):
        """Mean next-token cross-entropy as fla computes it: position t predicts labels
        (default input_ids) at t+1; the last position and labels of -100 are ignored
        (packed with cu_seqlens: set each sequence's first label to -100, or its
        predecessor learns across the boundary)."""
        logits = self(input_ids, attention_mask, cu_seqlens)
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
    def from_pretrained(cls, path, *, dtype=None, mode="auto", platform="auto"):
        """Load a directory fla or `save_pretrained` wrote (config.json, model.safetensors or
        the sharded index), strictly. `dtype` (a torch dtype): the parameters' dtype; by
        default the checkpoint's own (float32 when its arrays mix dtypes)."""
        config, params = checkpoint.load_pretrained(path)
        if dtype is None:
            dtypes = {_to_torch(a[:0]).dtype for a in params.values()}
            dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
        model = cls(config, mode=mode, platform=platform).to(dtype)
        model.load_params(params)
        return model

    def save_pretrained(self, path, *, max_shard_size=None) -> None:
        """Write config.json and model.safetensors (or shards of at most max_shard_size,
        bytes or '5GB', with model.safetensors.index.json) under fla's names."""
        params = {n: _to_numpy(t) for n, t in self.params().items()}
        checkpoint.save_pretrained(os.fspath(path), self.config, params,
                                   max_shard_size=max_shard_size)

    # ---------------------------------------------------------------- generation
    @torch.no_grad()
    def generate(self, input_ids, max_new_tokens, *, temperature=0.0, top_k=None,
                 eos_token_id=None, attention_mask=None, cu_seqlens=None, seed=None,
                 generator=None):
        """New tokens [N, max_new_tokens] after each prompt (N = B, or len(cu_seqlens) - 1
        with input_ids packed [1, total]). Prompts of different lengths: left padding
        with attention_mask [B, T], or packed with cu_seqlens.

        temperature 0: greedy (argmax, the first on ties); > 0: samples softmax(logits /
        temperature) over the top_k largest (all when None), from `generator` (a
        torch.Generator) or a fresh one seeded with `seed`. eos_token_id (an id or a list):
        a sequence that emits one is done; its later tokens are config.pad_token_id, or
        the eos id it emitted when there is none."""
        eos = list(generate_options(self.config, max_new_tokens, temperature, top_k,
                                    eos_token_id))
        h = self.model.embed(input_ids)  # checks input_ids
        device = input_ids.device
        if cu_seqlens is not None:
            cu = torch.as_tensor(cu_seqlens).to(device=device, dtype=torch.long)
            check_prompt_offsets(cu.cpu().numpy(), input_ids.shape[0], input_ids.shape[1])
            last = cu[1:] - 1
        elif attention_mask is not None:
            if tuple(attention_mask.shape) != tuple(input_ids.shape) or \
                    not bool(attention_mask[:, -1].bool().all()):
                raise ValueError("attention_mask: expected [B, T] with left padding (every "
                                 "prompt's last token real)")
        if generator is None and temperature > 0:
            generator = torch.Generator(device)
            if seed is not None:
                generator.manual_seed(seed)
            else:
                generator.seed()
        h, states = self.model(inputs_embeds=h, attention_mask=attention_mask,
                               cu_seqlens=None if cu_seqlens is None else cu, use_cache=True)
        h = h[0, last] if cu_seqlens is not None else h[:, -1]
        N = h.shape[0]
        out = torch.empty(N, max_new_tokens, dtype=torch.long, device=device)
        done = torch.zeros(N, dtype=torch.bool, device=device)
        fill = torch.zeros(N, dtype=torch.long, device=device)
        eos_t = torch.tensor(eos, dtype=torch.long, device=device)
        pad = self.config.pad_token_id
        for i in range(max_new_tokens):
            tok = _pick(self.lm_head(h).float(), temperature, top_k, generator)
            if eos:
                tok = torch.where(done, fill, tok)
                new = ~done & torch.isin(tok, eos_t)
                fill = torch.where(new, tok if pad is None else torch.full_like(tok, pad), fill)
                done |= new
            out[:, i] = tok
            if i + 1 == max_new_tokens:
                break
            if eos and bool(done.all()):
                out[:, i + 1:] = fill[:, None]
                break
            h, states = self.model(tok[:, None], states=states, use_cache=True)
            h = h[:, -1]
        return out


def causal_lm_loss(logits, labels):
    """Mean cross-entropy of logits [B, T, vocab] at t against labels [B, T] at t+1 (fla's
    shift: the last position and labels of -100 are ignored), in float32."""
    shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], 1)
    return F.cross_entropy(logits.flatten(0, 1).float(), shifted.flatten(), ignore_index=-100)


def _pick(logits, temperature, top_k, generator):
    """The next token of each row of logits [N, V] (see GLAForCausalLM.generate)."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -float("inf"))
    return torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)[:, 0]
