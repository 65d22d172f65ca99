"""The GLA language model in JAX, a Flax NNX module tree: GLAModel and GLAForCausalLM.

flash-linear-attention's GLA model (structure, parameter names, init;
bridge/model_config.py): token embedding; per block RMSNorm -> GLA attention ->
residual -> RMSNorm -> SwiGLU MLP -> residual; final RMSNorm; lm head (the embedding's
transpose when config.tie_word_embeddings). The attention is jax_side.layers.gla_apply
over the block's parameters. Parameter paths are fla's names (`model.layers.0.attn.
q_proj.weight`, ...), Linear weights [out, in] as torch stores them, so checkpoints move
between fla, torch_side.models and this model without renaming or transposing
(`from_pretrained` / `save_pretrained`: safetensors, no torch import).

dtypes: `param_dtype` (default float32) is the parameters' dtype, `dtype` (default
param_dtype) the computation's: activations, matmul operands and logits; norms, gates
and recurrent states run in float32 whatever `dtype` is.

Sharding: each parameter is annotated (`nnx.Param(..., out_sharding=spec)`) over one mesh
axis, `model_axis` (default "model"): tensor parallelism over vocabulary (embedding, lm
head), attention heads (q/k/v/g projections and the gate's output rows; o_proj's
columns) and the MLP's hidden units (gate/up rows, down_proj's columns); norms and the
gate's low-rank input projection are replicated. `model_axis=None` leaves everything
unannotated. Created under `jax.set_mesh(mesh)` (a mesh with that axis), the
parameters are placed by those specs (Flax's eager sharding); without a mesh they stay
on one device and `nnx.get_partition_spec(nnx.state(model))` gives the specs. Batches
shard over any other mesh axis (say "data") by sharding input_ids. Head sharding needs
num_heads and num_kv_heads divisible by the axis size.

Recurrent state: `states` is a list with one [N, H, K, V] float32 state per layer.
`generate` (transformers' decoding options, jax_side.decoding) runs the prompt as one
chunked call per layer, then one recurrent step per layer for each new token, all in
one jax.jit-compiled lax.while_loop.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bridge import checkpoint
from bridge.model_config import GLAConfig, init_rule
from . import decoding
from .layers import gla_apply, linear, rms_norm

MODEL_AXIS = "model"


class _Init:
    """Makes the parameters of one model: fla's init rule, param_dtype, the sharding
    spec over `axis` (None: unannotated); eager placement only under a mesh."""

    def __init__(self, rngs, param_dtype, std, axis):
        self.rngs, self.dtype, self.std, self.axis = rngs, param_dtype, std, axis
        mesh = jax.sharding.get_abstract_mesh()
        if axis is not None and not mesh.empty and axis not in mesh.axis_names:
            raise ValueError(f"model_axis: {axis!r} is not an axis of the mesh "
                             f"{mesh.axis_names}; name the mesh's tensor-parallel axis, or "
                             f"model_axis=None for replicated parameters")

    def __call__(self, name, shape, spec):
        rule = init_rule(name)
        if rule == "ones":
            value = jnp.ones(shape, self.dtype)
        elif rule == "zeros":
            value = jnp.zeros(shape, self.dtype)
        else:
            value = self.std * jax.random.normal(self.rngs.params(), shape, self.dtype)
        spec = tuple(self.axis if s == "tp" else None for s in spec)
        # without a mesh there is nothing to place on: keep the spec as metadata only
        eager = None if not jax.sharding.get_abstract_mesh().empty else False
        return nnx.Param(value, out_sharding=spec, eager_sharding=eager)


class Linear(nnx.Module):
    """y = x @ weight.T (+ bias); weight [out, in]. `shard`: "out" (rows over the model
    axis), "in" (columns) or None (replicated)."""

    def __init__(self, d_in, d_out, init, *, bias=False, shard="out"):
        spec = {"out": ("tp", None), "in": (None, "tp"), None: (None, None)}[shard]
        self.weight = init("weight", (d_out, d_in), spec)
        self.bias = init("bias", (d_out,), spec[:1]) if bias else None

    def __call__(self, x):
        return linear(x, self.weight[...], None if self.bias is None else self.bias[...])


class RMSNorm(nnx.Module):
    """RMSNorm over the last dim, in float32, returned in x's dtype."""

    def __init__(self, dim, eps, init, name="norm"):
        self.eps = eps
        self.weight = init(f"{name}.weight", (dim,), (None,))

    def __call__(self, x):
        return rms_norm(x, self.weight[...], self.eps)


class GatedLinearAttention(nnx.Module):
    """fla's GLA layer as a module over jax_side.layers.gla_apply (the same math and
    parameter names; config: a bridge.weights.LayerConfig)."""

    def __init__(self, config, init, *, mode="auto", platform="auto"):
        c = self.config = config
        self.mode, self.platform = mode, platform
        D, Hk, R = c.hidden_size, c.kv_heads, c.gate_low_rank_dim
        self.q_proj = Linear(D, c.key_dim, init)
        self.k_proj = Linear(D, Hk * c.head_k_dim, init)
        self.v_proj = Linear(D, Hk * c.head_v_dim, init)
        self.gk_proj = nnx.List([Linear(D, R, init, shard=None),
                                 Linear(R, Hk * c.head_k_dim, init, bias=True)])
        if c.use_output_gate:
            self.g_proj = Linear(D, c.value_dim, init)
        norm = c.norm_param.removesuffix(".weight")  # fla's name: g_norm(_swish_gate)
        setattr(self, norm, RMSNorm(c.head_v_dim, c.norm_eps, init, norm))
        self.o_proj = Linear(c.value_dim, D, init, shard="in")

    def __call__(self, x, attention_mask=None, cu_seqlens=None, state=None, use_cache=False):
        params = {name: v[...] for name, v in named_params(self).items()}
        return gla_apply(params, x, self.config, attention_mask=attention_mask,
                         cu_seqlens=cu_seqlens, state=state, use_cache=use_cache,
                         mode=self.mode, platform=self.platform)


class GLAMLP(nnx.Module):
    """SwiGLU: down_proj(silu(gate_proj(x)) * up_proj(x)) (fla's GatedMLP)."""

    def __init__(self, hidden_size, intermediate_size, init):
        self.gate_proj = Linear(hidden_size, intermediate_size, init)
        self.up_proj = Linear(hidden_size, intermediate_size, init)
        self.down_proj = Linear(intermediate_size, hidden_size, init, shard="in")

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class GLABlock(nnx.Module):
    """h + attn(attn_norm(h)), then + mlp(mlp_norm(.)); returns (h, state or None)."""

    def __init__(self, config: GLAConfig, init, *, mode="auto", platform="auto"):
        D, eps = config.hidden_size, config.norm_eps
        self.attn_norm = RMSNorm(D, eps, init)
        self.attn = GatedLinearAttention(config.layer, init, mode=mode, platform=platform)
        self.mlp_norm = RMSNorm(D, eps, init)
        self.mlp = GLAMLP(D, config.mlp_size, init)

    def __call__(self, h, attention_mask=None, cu_seqlens=None, state=None, use_cache=False):
        a = self.attn(self.attn_norm(h), attention_mask, cu_seqlens, state, use_cache)
        a, state = a if use_cache else (a, None)
        h = h + a
        return h + self.mlp(self.mlp_norm(h)), state


def named_params(module) -> dict:
    """{fla name: nnx.Param} of a module's parameters (paths joined with dots)."""
    flat = nnx.to_flat_state(nnx.state(module, nnx.Param))
    return {".".join(map(str, path)): v for path, v in flat}


def _check_config(config):
    if not isinstance(config, GLAConfig):
        raise TypeError(f"config: expected a bridge.model_config.GLAConfig, "
                        f"got {type(config).__name__}")
    return config


def _check_ids(input_ids, V):
    """ValueError unless input_ids is an integer array [B, T] of ids in [0, V) (the
    range is checked where the values are known, outside a trace)."""
    shape, dtype = getattr(input_ids, "shape", None), getattr(input_ids, "dtype", None)
    if shape is None or len(shape) != 2 or not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(f"input_ids: expected an integer array [B, T], got {dtype} "
                         f"{tuple(shape) if shape is not None else type(input_ids).__name__}")
    if not isinstance(input_ids, jax.core.Tracer) and input_ids.size:
        lo, hi = int(np.min(input_ids)), int(np.max(input_ids))
        if lo < 0 or hi >= V:
            raise ValueError(f"input_ids: expected token ids in [0, vocab_size={V}), "
                             f"got [{lo}, {hi}]")


class Embedding(nnx.Module):
    """weight [vocab, D] (rows over the model axis); ids -> rows."""

    def __init__(self, vocab, dim, init):
        self.weight = init("embeddings.weight", (vocab, dim), ("tp", None))

    def __call__(self, ids):
        return jnp.take(self.weight[...], ids, axis=0)


class GLAModel(nnx.Module):
    """Embedding, blocks, final norm (fla's GLAModel).

    GLAModel(config, *, rngs, dtype=None, param_dtype=float32, model_axis="model",
    mode="auto", platform="auto"); mode / platform go to every attention call
    (jax_side.ops.recurrent).

    __call__(input_ids [B, T] (or [1, total] with cu_seqlens [N+1]), attention_mask
    [B, T] (1 = token, 0 = padding), cu_seqlens, states (list of [N, H, K, V], one per
    layer), use_cache, inputs_embeds [B, T, D] instead of input_ids) -> hidden
    [B, T, D], or (hidden, states) when use_cache."""

    def __init__(self, config: GLAConfig, *, rngs: nnx.Rngs, dtype=None,
                 param_dtype=jnp.float32, model_axis=MODEL_AXIS, mode="auto",
                 platform="auto", _init=None):
        self.config = _check_config(config)
        self.dtype = param_dtype if dtype is None else dtype
        init = _init or _Init(rngs, param_dtype, config.initializer_range, model_axis)
        self.embeddings = Embedding(config.vocab_size, config.hidden_size, init)
        self.layers = nnx.List([GLABlock(config, init, mode=mode, platform=platform)
                                for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.norm_eps, init)

    def embed(self, input_ids):
        """input_ids [B, T] (integers in [0, vocab)) -> [B, T, D] in the model's dtype."""
        _check_ids(input_ids, self.config.vocab_size)
        return self.embeddings(input_ids).astype(self.dtype)

    def __call__(self, input_ids=None, attention_mask=None, cu_seqlens=None, states=None,
                 use_cache=False, inputs_embeds=None):
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("input_ids: give exactly one of input_ids and inputs_embeds")
        mesh = jax.sharding.get_abstract_mesh()
        if not mesh.empty and jax.sharding.AxisType.Explicit in mesh.axis_types:
            raise ValueError(f"mesh: the model runs under meshes with Auto axes (jax.make_mesh("
                             f"..., axis_types=(AxisType.Auto, ...))), got {mesh}")
        h = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        L = len(self.layers)
        if states is not None and (not isinstance(states, (list, tuple)) or len(states) != L):
            raise ValueError(f"states: expected a list of {L} per-layer states [N, H, K, V], "
                             f"got {type(states).__name__} of "
                             f"{len(states) if isinstance(states, (list, tuple)) else '?'}")
        out = []
        for i, layer in enumerate(self.layers):
            h, s = layer(h, attention_mask, cu_seqlens, None if states is None else states[i],
                         use_cache)
            out.append(s)
        h = self.norm(h)
        return (h, out) if use_cache else h


class GLAForCausalLM(nnx.Module):
    """GLAModel and the lm head (fla's GLAForCausalLM), initialised as fla does
    (normal(0, initializer_range) Linear and embedding weights, zero biases, unit norms)
    from `rngs`. Arguments as GLAModel's.

    __call__(input_ids, attention_mask=None, cu_seqlens=None, states=None,
    use_cache=False, inputs_embeds=None) -> logits [B, T, vocab] (in `dtype`), or
    (logits, states) when use_cache."""

    def __init__(self, config: GLAConfig, *, rngs: nnx.Rngs, dtype=None,
                 param_dtype=jnp.float32, model_axis=MODEL_AXIS, mode="auto",
                 platform="auto"):
        self.config = _check_config(config)
        init = _Init(rngs, param_dtype, config.initializer_range, model_axis)
        self.model = GLAModel(config, rngs=rngs, dtype=dtype, param_dtype=param_dtype,
                              mode=mode, platform=platform, _init=init)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, init)

    def logits(self, h):
        """hidden [..., D] -> logits [..., vocab] (the tied embedding's transpose or lm_head)."""
        if self.config.tie_word_embeddings:
            return linear(h, self.model.embeddings.weight[...])
        return self.lm_head(h)

    def __call__(self, input_ids=None, attention_mask=None, cu_seqlens=None, states=None,
                 use_cache=False, inputs_embeds=None):
        out = self.model(input_ids, attention_mask, cu_seqlens, states, use_cache,
                         inputs_embeds)
        h, states = out if use_cache else (out, None)
        logits = self.logits(h)
        return (logits, states) if use_cache else logits

    def loss(self, input_ids, labels=None, attention_mask=None, cu_seqlens=None):
        """Mean next-token cross-entropy as fla computes it: position t predicts labels
        (default input_ids) at t+1; the last position and labels of -100 are ignored."""
        logits = self(input_ids, attention_mask, cu_seqlens)
        return causal_lm_loss(logits, input_ids if labels is None else labels)

    # ---------------------------------------------------------------- checkpoints
    def params(self) -> dict:
        """{fla name: array} of every parameter (model_param_shapes' names)."""
        return {name: v[...] for name, v in named_params(self).items()}

    def load_params(self, params: dict) -> None:
        """Set every parameter from `params` ({fla name: array}: NumPy, jax, or anything
        with __array__ / DLPack, e.g. a torch model's `params()`), strictly
        (bridge.checkpoint.check_model_params: ValueError before anything changes), cast
        to each parameter's dtype and placed by its spec under a mesh."""
        nnx.update(self, _loaded_state(nnx.state(self, nnx.Param), params, self.config))

    @classmethod
    def from_pretrained(cls, path, *, dtype=None, param_dtype=None, model_axis=MODEL_AXIS,
                        mode="auto", platform="auto"):
        """Load a directory fla, torch_side or `save_pretrained` wrote (config.json,
        model.safetensors or the sharded index), strictly, without torch. param_dtype:
        by default the checkpoint's own (float32 when its arrays mix dtypes). Under
        `jax.set_mesh(mesh)` each parameter is placed by its sharding spec."""
        config, params = checkpoint.load_pretrained(os.fspath(path))
        if param_dtype is None:
            dtypes = {a.dtype for a in params.values()}
            param_dtype = dtypes.pop() if len(dtypes) == 1 else np.dtype("float32")
        abstract = nnx.eval_shape(lambda: cls(
            config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=param_dtype,
            model_axis=model_axis, mode=mode, platform=platform))
        graphdef, state = nnx.split(abstract)
        return nnx.merge(graphdef, _loaded_state(state, params, config))

    def save_pretrained(self, path, *, max_shard_size=None) -> None:
        """Write config.json and model.safetensors (or shards of at most max_shard_size,
        bytes or '5GB', with model.safetensors.index.json) under fla's names."""
        params = {n: np.asarray(jax.device_get(a)) for n, a in self.params().items()}
        checkpoint.save_pretrained(os.fspath(path), self.config, params,
                                   max_shard_size=max_shard_size)

    # ---------------------------------------------------------------- generation
    def generate(self, input_ids, max_new_tokens, *, attention_mask=None, cu_seqlens=None,
                 do_sample=False, temperature=1.0, top_k=None, top_p=None,
                 repetition_penalty=None, eos_token_id=decoding.FROM_CONFIG,
                 pad_token_id=decoding.FROM_CONFIG, rng=None, seed=None):
        """New tokens [N, max_new_tokens] (int32) after each prompt (N = B, or
        len(cu_seqlens) - 1 with input_ids packed [1, total]). Prompts of different
        lengths: left padding with attention_mask [B, T], or packed with cu_seqlens.

        transformers' options and defaults: do_sample=False is greedy (argmax, the first
        on ties); do_sample=True samples with `rng` (a jax.random key) or
        jax.random.key(seed), after temperature, top_k, top_p (jax_side.decoding.
        process_logits: transformers' processors). repetition_penalty (greedy or not)
        penalises every token the prompt holds or the row has emitted. eos_token_id (an
        id or a list; default the config's, None for none): a sequence that emits one is
        done; its later tokens are pad_token_id (default the config's), or the eos id it
        emitted when there is none; when every sequence is done the loop stops. One
        compile per (shapes, max_new_tokens, do_sample, top_k, whether top_p and
        repetition_penalty are given, number of eos ids); their values are traced."""
        cfg = self.config
        eos, pad = decoding.check_options(cfg, max_new_tokens, do_sample, temperature, top_k,
                                          top_p, repetition_penalty, eos_token_id,
                                          pad_token_id)
        _check_ids(input_ids, cfg.vocab_size)
        ids = jnp.asarray(input_ids)
        if cu_seqlens is not None:
            if attention_mask is not None:
                raise ValueError("attention_mask: give either attention_mask or cu_seqlens, "
                                 "not both")
            cu = np.asarray(cu_seqlens)
            decoding.check_prompt_offsets(cu, ids.shape[0], ids.shape[1])
            N = len(cu) - 1
            cu_seqlens = jnp.asarray(cu, jnp.int32)
        else:
            N = ids.shape[0]
            if attention_mask is not None:
                m = np.asarray(attention_mask)
                if m.shape != tuple(ids.shape) or not m[:, -1].astype(bool).all():
                    raise ValueError("attention_mask: expected [B, T] with left padding "
                                     "(every prompt's last token real)")
                attention_mask = jnp.asarray(m)
        if not do_sample:
            key = jax.random.key(0)  # unused
        elif rng is not None:
            key = rng
        elif seed is not None:
            key = jax.random.key(seed)
        else:
            raise ValueError("rng: sampling (do_sample=True) needs rng= (a jax.random key) "
                             "or seed=")
        if max_new_tokens == 0:
            return jnp.zeros((N, 0), jnp.int32)
        graphdef, state = nnx.split(self)
        f32 = lambda v: jnp.float32(1.0 if v is None else v)  # noqa: E731
        return decoding.decode(
            graphdef, state, ids, attention_mask, cu_seqlens, key, f32(temperature), f32(top_p),
            f32(repetition_penalty), jnp.asarray(eos or (-1,), jnp.int32), jnp.int32(pad),
            max_new_tokens=max_new_tokens, sample=do_sample, top_k=top_k,
            use_top_p=top_p is not None, use_penalty=repetition_penalty is not None)


def causal_lm_loss(logits, labels):
    """Mean cross-entropy of logits [B, T, vocab] at t against labels [B, T] at t+1 (fla's
    shift: the last position and labels of -100 are ignored), in float32."""
    shifted = jnp.concatenate([labels[:, 1:], jnp.full_like(labels[:, :1], -100)], 1)
    keep = shifted != -100
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
    picked = jnp.take_along_axis(logp, jnp.where(keep, shifted, 0)[..., None], -1)[..., 0]
    return -jnp.sum(jnp.where(keep, picked, 0.0)) / jnp.maximum(jnp.sum(keep), 1)


def _loaded_state(state, params, config):
    """`state` (an nnx.State of Params, concrete or abstract) with values from `params`
    ({fla name: array}), checked strictly, cast to each Param's dtype, and placed by its
    sharding spec when a mesh is set (jax.set_mesh)."""
    checkpoint.check_model_params(params, config)
    mesh = None if jax.sharding.get_abstract_mesh().empty else jax.sharding.get_mesh()
    flat = []
    for path, var in nnx.to_flat_state(state):
        name = ".".join(map(str, path))
        if not isinstance(var, nnx.Param):
            flat.append((path, var))
            continue
        value = _as_jax(params[name]).astype(var.dtype)
        if mesh is not None and not mesh.empty:
            spec = nnx.spmd.get_var_pspec(var)
            value = jax.device_put(value, jax.sharding.NamedSharding(mesh, spec))
        flat.append((path, var.replace(value)))
    return nnx.from_flat_state(flat)


def _as_jax(x):
    """A copy of a NumPy / jax array, or of anything DLPack hands over (a torch tensor)."""
    if isinstance(x, (jax.Array, np.ndarray)):
        return jnp.array(x, copy=True)
    if hasattr(x, "detach"):  # torch: DLPack refuses tensors that require grad
        x = x.detach()
    return jnp.array(jax.dlpack.from_dlpack(x), copy=True)
