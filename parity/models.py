"""`python -m parity --model`: a small random-weight GLA language model, one checkpoint
directory, loaded by every model backend (torch native / Triton, JAX XLA / Triton /
Pallas) and checked against a float64 NumPy model built on parity/oracle.py: the
logits of a left-padded batch (fp32 and bf16), and 32 greedy tokens from three
prompts of different lengths (fp32), which must equal the float64 model's.

The float64 model is fla's GLA model written out here (embedding; per block RMSNorm ->
GLA attention -> residual -> RMSNorm -> SwiGLU -> residual; final norm; lm head),
with the recurrence from the oracle and nothing from the project's models.
"""

import functools
import os
import tempfile
import time

import numpy as np

from . import oracle
from .compare import rel_err, tolerance

# the tests' small model (tests/test_models_torch.py): fla's defaults, and the options
# that change the math (kv groups, tied head, clamped gates, a feature map, no gate)
BASE = dict(hidden_size=32, num_heads=2, num_hidden_layers=2, vocab_size=64,
            intermediate_size=48, initializer_range=0.2)
CONFIGS = {
    "fla-defaults": dict(),
    "gqa-tied-clamp-sigmoid": dict(num_kv_heads=1, tie_word_embeddings=True,
                                   clamp_min=-0.05, feature_map="sigmoid",
                                   use_output_gate=False),
}
BACKENDS = ("torch-torch", "torch-triton", "jax-xla", "jax-triton", "jax-pallas")
PROMPT_LENGTHS = (7, 3, 5)
STEPS = 32
DTYPES = ("float32", "bfloat16")
# fp32: the bar for torch vs JAX logits (tighter than the op parity's 2e-5)
TOLERANCE = {"float32": 1e-5, "bfloat16": tolerance("bfloat16")}


def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


FEATURE_MAPS = {  # fla's ACT2FN in float64 (gelu: its tanh approximation)
    "relu": lambda x: np.maximum(x, 0), "sigmoid": _sigmoid,
    "logsigmoid": lambda x: -np.logaddexp(0.0, -x), "swish": lambda x: x * _sigmoid(x),
    "silu": lambda x: x * _sigmoid(x), "sqrelu": lambda x: np.maximum(x, 0) ** 2,
    "gelu": lambda x: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3))),
}


def random_params(config, seed=0) -> dict:
    """{fla name: float32 array}: fla's normal init, with norm weights and gate biases
    drawn from U(0.5, 1.5) instead of 1 / 0, so that they are tested too."""
    from bridge.model_config import init_rule, model_param_shapes

    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in model_param_shapes(config).items():
        if init_rule(name) == "normal":
            out[name] = rng.normal(0.0, config.initializer_range, shape)
        else:
            out[name] = rng.uniform(0.5, 1.5, shape)
    return {n: a.astype(np.float32) for n, a in out.items()}


def reference_logits(config, params, ids, mask=None):
    """The float64 model: ids [B, T] (mask [B, T], 1 = token) -> logits [B, T, vocab]."""
    p = {n: np.asarray(a, np.float64) for n, a in params.items()}
    c, lc = config, config.layer
    H, Hk, K, V = lc.num_heads, lc.kv_heads, lc.head_k_dim, lc.head_v_dim
    B, T = ids.shape
    keep = np.ones((B, T, 1, 1)) if mask is None else np.asarray(mask, np.float64)[..., None, None]

    def rms(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + c.norm_eps) * w

    def silu(x):
        return x * _sigmoid(x)

    h = p["model.embeddings.weight"][ids]
    for i in range(c.num_hidden_layers):
        a = f"model.layers.{i}.attn."
        x = rms(h, p[f"model.layers.{i}.attn_norm.weight"])
        q = (x @ p[a + "q_proj.weight"].T).reshape(B, T, H, K)
        k = (x @ p[a + "k_proj.weight"].T).reshape(B, T, Hk, K)
        v = (x @ p[a + "v_proj.weight"].T).reshape(B, T, Hk, V)
        if lc.feature_map is not None:
            q, k = FEATURE_MAPS[lc.feature_map](q), FEATURE_MAPS[lc.feature_map](k)
        z = (x @ p[a + "gk_proj.0.weight"].T) @ p[a + "gk_proj.1.weight"].T \
            + p[a + "gk_proj.1.bias"]
        gk = -np.logaddexp(0.0, -z) / lc.gate_logit_normalizer
        if lc.clamp_min is not None:
            gk = np.maximum(gk, lc.clamp_min)
        gk = np.repeat(gk.reshape(B, T, Hk, K), H // Hk, axis=2)
        o, _ = oracle.recurrent_gla(q * keep, k * keep, v * keep, g=gk * keep)
        o = rms(o, p[a + lc.norm_param])
        if lc.use_output_gate:
            o = o * silu((x @ p[a + "g_proj.weight"].T).reshape(B, T, H, V))
        h = h + o.reshape(B, T, H * V) @ p[a + "o_proj.weight"].T
        m = f"model.layers.{i}.mlp."
        x = rms(h, p[f"model.layers.{i}.mlp_norm.weight"])
        h = h + (silu(x @ p[m + "gate_proj.weight"].T) * (x @ p[m + "up_proj.weight"].T)) \
            @ p[m + "down_proj.weight"].T
    h = rms(h, p["model.norm.weight"])
    head = p["model.embeddings.weight" if c.tie_word_embeddings else "lm_head.weight"]
    return h @ head.T


def reference_greedy(config, params, prompts, steps) -> np.ndarray:
    """[N, steps] greedy tokens of the float64 model, each prompt alone."""
    out = []
    for prompt in prompts:
        seq = list(prompt)
        for _ in range(steps):
            seq.append(int(np.argmax(reference_logits(config, params, np.array([seq]))[0, -1])))
        out.append(seq[len(prompt):])
    return np.array(out)


def inputs(seed, vocab):
    """(batch [2, 16] with row 1 left-padded by 5, its mask, the prompts (lengths
    PROMPT_LENGTHS), the prompts left-padded [3, 7], their mask). Padding holds real
    ids: only the mask may hide them."""
    rng = np.random.default_rng(seed + 1)
    x = rng.integers(0, vocab, (2, 16))
    mask = np.ones((2, 16), np.int64)
    mask[1, :5] = 0
    prompts = [rng.integers(0, vocab, n) for n in PROMPT_LENGTHS]
    T = max(PROMPT_LENGTHS)
    padded, pmask = np.full((3, T), 9), np.zeros((3, T), np.int64)
    for i, pr in enumerate(prompts):
        padded[i, T - len(pr):], pmask[i, T - len(pr):] = pr, 1
    return x, mask, prompts, padded, pmask


class ModelBackend:
    """One framework and platform: loads a checkpoint directory, returns logits and
    greedy tokens as NumPy."""

    def __init__(self, name):
        self.name = name
        self.framework, self.platform = name.split("-")
        self.interpreted = False

    def unavailable(self):
        import importlib.util

        need = {"torch": ("torch", "safetensors"), "jax": ("jax", "flax", "safetensors")}
        need = need[self.framework] + (("triton", "torch") if self.platform == "triton" else ())
        for dep in need:
            if importlib.util.find_spec(dep) is None:
                return f"{dep} is not installed"
        if self.platform == "triton":
            from bridge import kernels

            self.interpreted = kernels.INTERPRETED
        if self.platform == "pallas":
            import jax

            self.interpreted = jax.default_backend() != "tpu"
        return None

    def load(self, path, dtype):
        if self.framework == "torch":
            import torch

            from torch_side.models import GLAForCausalLM

            return GLAForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype),
                                                  platform=self.platform)
        import jax.numpy as jnp

        from jax_side.models import GLAForCausalLM

        return GLAForCausalLM.from_pretrained(path, param_dtype=getattr(jnp, dtype),
                                              platform=self.platform)

    def logits(self, model, ids, mask):
        if self.framework == "torch":
            import torch

            with torch.no_grad():
                out = model(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                            use_cache=False).logits
            return out.float().numpy()
        import jax.numpy as jnp

        out = jax_forward(model, jnp.asarray(ids, jnp.int32), jnp.asarray(mask, jnp.int32))
        return np.asarray(out.astype(jnp.float32))

    def generate(self, model, padded, mask, steps):
        if self.framework == "torch":
            import torch

            out = model.generate(torch.from_numpy(padded), max_new_tokens=steps,
                                 attention_mask=torch.from_numpy(mask), eos_token_id=None,
                                 pad_token_id=0)
            return out[:, padded.shape[1]:].numpy()
        import jax.numpy as jnp

        return np.asarray(model.generate(jnp.asarray(padded, jnp.int32), steps,
                                         attention_mask=jnp.asarray(mask, jnp.int32),
                                         eos_token_id=None))


@functools.lru_cache(maxsize=None)
def _jitted_forward():
    from flax import nnx

    return nnx.jit(lambda m, x, mask: m(x, attention_mask=mask))


def jax_forward(model, ids, mask):
    """A JAX model's logits under one jitted function per process (made on first use,
    so importing this module needs no jax): callers of the same shapes share its compile."""
    return _jitted_forward()(model, ids, mask)


def compare(backends, configs=tuple(CONFIGS), seed=0, steps=STEPS, dtypes=DTYPES,
            progress=None, params_for=None):
    """Rows per (config, dtype): each backend against the float64 model ("against":
    "float64"), then each pair of backends against each other: the logits' relative
    error and, in fp32, how many greedy tokens agree. `params_for(backend_name,
    params)` may alter a backend's weights (tests: a wrong backend must be reported)."""
    from bridge import checkpoint
    from bridge.model_config import GLAConfig

    rows = []
    for name in configs:
        config = GLAConfig(**BASE, **CONFIGS[name])
        params = random_params(config, seed)
        x, mask, prompts, padded, pmask = inputs(seed, config.vocab_size)
        keep = mask.astype(bool)
        logits = reference_logits(config, params, x, mask)[keep]
        ref = {d: (logits, reference_greedy(config, params, prompts, steps)
                   if d == "float32" else None) for d in dtypes}
        results = {d: {} for d in dtypes}
        with tempfile.TemporaryDirectory() as tmp:
            for b in backends:
                mine = params if params_for is None else params_for(b.name, params)
                path = os.path.join(tmp, b.name)
                checkpoint.save_pretrained(path, config, mine)
                for dtype in dtypes:
                    t0 = time.time()
                    try:
                        model = b.load(path, dtype)
                        results[dtype][b.name] = (
                            b.logits(model, x, mask)[keep],
                            b.generate(model, padded, pmask, steps) if dtype == "float32" else None)
                        error = None
                    except Exception as e:  # a failing backend is a mismatch, not a crash
                        error = f"{type(e).__name__}: {e}"
                    rows.append(_row(name, dtype, b.name, "float64", results[dtype].get(b.name),
                                     ref[dtype], error))
                    if progress:
                        progress(f"{name} {dtype} {b.name}: {time.time() - t0:.1f}s")
        for dtype in dtypes:
            done = list(results[dtype])
            for i, a in enumerate(done):
                for b in done[i + 1:]:
                    rows.append(_row(name, dtype, a, b, results[dtype][a], results[dtype][b]))
    return rows


def _row(config, dtype, backend, against, got, want, error=None):
    row = dict(config=config, dtype=dtype, backend=backend, against=against,
               tol=TOLERANCE[dtype], err=float("inf"), tokens=None, of=None, error=error)
    if got is not None:
        row["err"] = rel_err(got[0], want[0])
        if want[1] is not None:
            row["tokens"], row["of"] = int((got[1] == want[1]).sum()), want[1].size
    row["ok"] = error is None and row["err"] <= row["tol"] and row["tokens"] == row["of"]
    return row


def table(rows) -> str:
    """One line per row: logits error and greedy tokens agreeing, against the float64
    model, then between backends."""
    lines = [f"GLA model ({', '.join(f'{k}={v}' for k, v in BASE.items())}): logits of a "
             f"left-padded batch (relative error) and greedy tokens from "
             f"{len(PROMPT_LENGTHS)} prompts of lengths {PROMPT_LENGTHS} (fp32)"]
    for title, sel in (("against the float64 model:", lambda r: r["against"] == "float64"),
                       ("between backends:", lambda r: r["against"] != "float64")):
        lines += [title, f"  {'config':<24} {'dtype':<9} {'backend':<28} {'logits':>8} "
                         f"{'tol':>6} {'tokens':>9}  result"]
        for r in filter(sel, rows):
            who = r["backend"] if r["against"] == "float64" else f"{r['backend']} vs {r['against']}"
            toks = "-" if r["of"] is None else f"{r['tokens']}/{r['of']}"
            lines.append(f"  {r['config']:<24} {r['dtype']:<9} {who:<28} {r['err']:>8.1e} "
                         f"{r['tol']:>6.0e} {toks:>9}  {'ok' if r['ok'] else 'FAIL'}")
    for r in rows:
        if r["error"]:
            lines.append(f"ERROR {r['config']} {r['dtype']} {r['backend']}: {r['error']}")
    return "\n".join(lines)
