"""The JAX GLA model's decoding: transformers' generation options under one jax.jit.

`generate` (jax_side.models.GLAForCausalLM.generate) checks its options here and runs
`decode`: the prompt in one chunked call per layer, then a `lax.while_loop` of one
recurrent step per layer and token, which ends after max_new_tokens or when every
sequence has emitted an eos id. Each step's logits go through `process_logits`, the
processors transformers' `generate` applies, in its order: repetition penalty, then (when
sampling) temperature, top-k, top-p.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

FROM_CONFIG = "config"  # generate's default eos / pad ids: the model config's, as transformers


def check_options(config, max_new_tokens, do_sample, temperature, top_k, top_p,
                  repetition_penalty, eos_token_id, pad_token_id) -> tuple:
    """ValueError naming the option unless generate's options are valid; returns (eos ids
    as a tuple, pad id or -1 for none)."""
    V = config.vocab_size
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or \
            max_new_tokens < 0:
        raise ValueError(f"max_new_tokens: expected an int >= 0, got {max_new_tokens!r}")
    if not isinstance(do_sample, bool):
        raise ValueError(f"do_sample: expected a bool, got {do_sample!r}")
    if not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature: expected a number > 0 (do_sample=False decodes "
                         f"greedily), got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k: expected None or an int >= 1, got {top_k!r}")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p: expected None or a number in (0, 1], got {top_p!r}")
    if repetition_penalty is not None and not (
            isinstance(repetition_penalty, (int, float)) and repetition_penalty > 0):
        raise ValueError(f"repetition_penalty: expected None or a number > 0, "
                         f"got {repetition_penalty!r}")
    if eos_token_id == FROM_CONFIG:
        eos_token_id = config.eos_token_id
    eos = () if eos_token_id is None else (eos_token_id,) if isinstance(
        eos_token_id, int) else tuple(eos_token_id)
    if not all(isinstance(e, int) and 0 <= e < V for e in eos):
        raise ValueError(f"eos_token_id: expected token ids in [0, {V}), got {eos_token_id!r}")
    if pad_token_id == FROM_CONFIG:
        pad_token_id = config.pad_token_id
    if pad_token_id is not None and not (isinstance(pad_token_id, int) and 0 <= pad_token_id < V):
        raise ValueError(f"pad_token_id: expected None or a token id in [0, {V}), "
                         f"got {pad_token_id!r}")
    return eos, -1 if pad_token_id is None else pad_token_id


def check_prompt_offsets(cu, rows: int, total: int) -> None:
    """Packed prompts: cu [N+1] (host values) increasing from 0 to `total`, input_ids
    [1, total] (`rows` == 1), every prompt non-empty."""
    cu = np.asarray(cu)
    if rows != 1 or cu.ndim != 1 or len(cu) < 2 or cu[0] != 0 or cu[-1] != total or \
            (np.diff(cu) <= 0).any():
        raise ValueError(f"cu_seqlens: expected increasing offsets from 0 to the token count "
                         f"{total} of input_ids [1, total] (every prompt non-empty), "
                         f"got {cu.tolist()}")


def process_logits(logits, seen, *, penalty=None, temperature=None, top_k=None, top_p=None):
    """logits [N, V] float32 as transformers' processors leave them: tokens `seen` [N, V]
    (bool) divided by `penalty` where positive, multiplied where not
    (RepetitionPenaltyLogitsProcessor); then / temperature; then every logit below the
    top_k-th largest -inf (ties kept); then -inf for the smallest whose probabilities sum
    to at most 1 - top_p (the largest always kept). None skips a step."""
    if penalty is not None:
        logits = jnp.where(seen, jnp.where(logits > 0, logits / penalty, logits * penalty),
                           logits)
    if temperature is not None:
        logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p is not None:
        order = jnp.argsort(logits, -1)  # ascending, as transformers sorts
        cum = jnp.cumsum(jax.nn.softmax(jnp.take_along_axis(logits, order, -1), -1), -1)
        drop = (cum <= 1 - top_p).at[:, -1].set(False)
        rows = jnp.arange(logits.shape[0])[:, None]
        logits = jnp.where(jnp.zeros_like(drop).at[rows, order].set(drop), -jnp.inf, logits)
    return logits


def _seen(ids, attention_mask, cu_seqlens, N, V):
    """[N, V] bool: the tokens each prompt holds (padding excluded)."""
    if cu_seqlens is not None:
        pos = jnp.arange(ids.shape[1])
        rows = jnp.searchsorted(cu_seqlens[1:], pos, side="right")
        return jnp.zeros((N, V), bool).at[rows, ids[0]].set(True)
    real = jnp.ones(ids.shape, bool) if attention_mask is None else attention_mask.astype(bool)
    rows = jnp.broadcast_to(jnp.arange(N)[:, None], ids.shape)
    return jnp.zeros((N, V), jnp.int32).at[rows, ids].add(real.astype(jnp.int32)) > 0


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "sample", "top_k",
                                             "use_top_p", "use_penalty"))
def decode(graphdef, state, ids, attention_mask, cu_seqlens, key, temperature, top_p, penalty,
           eos, pad, *, max_new_tokens, sample, top_k, use_top_p, use_penalty):
    """generate's compiled body (module docstring): new tokens [N, max_new_tokens] int32.
    eos [E] (-1: none) and pad (-1: a done row repeats its eos id) are traced."""
    model = nnx.merge(graphdef, state)
    h, states = model.model(ids, attention_mask=attention_mask, cu_seqlens=cu_seqlens,
                            use_cache=True)
    h = h[0, cu_seqlens[1:] - 1] if cu_seqlens is not None else h[:, -1]
    N, V = h.shape[0], model.config.vocab_size
    seen = _seen(ids, attention_mask, cu_seqlens, N, V) if use_penalty else None
    opts = dict(penalty=penalty if use_penalty else None)
    if sample:
        opts.update(temperature=temperature, top_k=top_k, top_p=top_p if use_top_p else None)

    def choose(h, i, done, fill, seen):
        logits = process_logits(model.logits(h).astype(jnp.float32), seen, **opts)
        if sample:
            tok = jax.random.categorical(jax.random.fold_in(key, i), logits, -1)
        else:
            tok = jnp.argmax(logits, -1)
        tok = jnp.where(done, fill, tok.astype(jnp.int32))
        new = ~done & jnp.isin(tok, eos)
        fill = jnp.where(new, jnp.where(pad < 0, tok, pad), fill)
        if seen is not None:
            seen = seen.at[jnp.arange(N), tok].set(True)
        return tok, done | new, fill, seen

    done = jnp.zeros((N,), bool)
    fill = jnp.zeros((N,), jnp.int32)
    tok, done, fill, seen = choose(h, 0, done, fill, seen)
    out = jnp.zeros((N, max_new_tokens), jnp.int32).at[:, 0].set(tok)

    def cond(carry):
        i, _, _, _, done, _, _ = carry
        return (i < max_new_tokens) & ~jnp.all(done)

    def body(carry):
        i, tok, states, out, done, fill, seen = carry
        h, states = model.model(tok[:, None], states=states, use_cache=True)
        tok, done, fill, seen = choose(h[:, -1], i, done, fill, seen)
        return i + 1, tok, states, out.at[:, i].set(tok), done, fill, seen

    i, _, _, out, done, fill, _ = jax.lax.while_loop(
        cond, body, (jnp.int32(1), tok, states, out, done, fill, seen))
    # columns the loop did not reach (everything done): the rows' fill tokens
    return jnp.where(jnp.arange(max_new_tokens)[None] >= i, fill[:, None], out)
