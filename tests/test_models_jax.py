"""The JAX GLA model (jax_side/models.py) on its own: prefill + decode against its own
full-sequence forward, generate's sampling and eos rules against its greedy tokens, its
logits processing against transformers' processors,
the sharding annotations, input errors, and a training step on a (data x model) mesh of
4 host devices against the same step on one device.

The torch and fla comparisons are in test_models_cross.py. XLA compiles cost seconds
each here, so the tests share a few jitted functions and shapes (module level)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from flax import nnx

from bridge.model_config import GLAConfig
from jax_side.models import GLAForCausalLM, named_params
from parity.compare import rel_err

ROOT = Path(__file__).resolve().parents[1]
SMALL = dict(hidden_size=32, num_heads=2, num_hidden_layers=2, vocab_size=64,
             intermediate_size=48, initializer_range=0.2)
GQA = dict(num_kv_heads=1, tie_word_embeddings=True, clamp_min=-0.05, feature_map="sigmoid",
           use_output_gate=False)


def jax_model(seed=0, **kw):
    """A small model with its norm weights and gate biases away from their 1 / 0 init."""
    m = GLAForCausalLM(GLAConfig(**SMALL, **kw), rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed + 100)
    m.load_params({n: rng.uniform(0.5, 1.5, a.shape).astype(np.float32)
                   if "norm" in n or n.endswith(".bias") else a for n, a in m.params().items()})
    return m


def ids(B, T, seed, V=64):
    return jnp.asarray(np.random.default_rng(seed).integers(0, V, (B, T)), jnp.int32)


full = nnx.jit(lambda m, x: m(x))
prefill = nnx.jit(lambda m, x: m(x, use_cache=True))
step = nnx.jit(lambda m, x, s: m(x, states=s, use_cache=True))


def test_prefill_then_decode_equals_the_full_forward_at_every_position():
    m = jax_model(**GQA)
    x = ids(2, 12, seed=4)
    logits, states = prefill(m, x[:, :5])  # the prompt: one chunked call per layer
    steps = [logits]
    for t in range(5, 12):  # then one recurrent step per layer and token
        logits, states = step(m, x[:, t:t + 1], states)
        steps.append(logits)
    assert len(states) == 2 and states[0].shape == m.config.layer.state_shape(2)
    assert states[0].dtype == jnp.float32
    assert rel_err(jnp.concatenate(steps, 1), full(m, x)) < 2e-5


# ---------------------------------------------------------------- generate
PROMPTS = [(7, 11), (3, 12), (5, 13)]  # (length, seed)


def padded_prompts():
    """The PROMPTS left-padded to [3, 7] (padding holds real ids: the mask must hide
    them) and their mask."""
    T = max(n for n, _ in PROMPTS)
    x, mask = np.full((3, T), 9, np.int32), np.zeros((3, T), np.int32)
    for i, (n, s) in enumerate(PROMPTS):
        x[i, T - n:], mask[i, T - n:] = np.asarray(ids(1, n, s))[0], 1
    return jnp.asarray(x), jnp.asarray(mask)


def test_generate_is_argmax_of_its_own_forward_and_eos_stops():
    """Greedy tokens are the argmax of the full forward over prompt + tokens (teacher
    forcing, one call); eos_token_id ends rows with the eos id, or pad_token_id."""
    m = jax_model(**GQA)
    x, mask = padded_prompts()
    new = m.generate(x, 32, attention_mask=mask, eos_token_id=None)
    assert new.shape == (3, 32) and new.dtype == jnp.int32
    seq = jnp.concatenate([x, new], 1)
    seq_mask = jnp.concatenate([mask, jnp.ones_like(new)], 1)
    logits = nnx.jit(lambda m, x, k: m(x, attention_mask=k))(m, seq, seq_mask)
    want = jnp.argmax(logits[:, 6:-1], -1)
    assert np.array_equal(new, want)

    # stop at the token row 0 emits third: its later tokens become that eos (no pad id)
    eos = int(new[0, 2])
    got = m.generate(x, 32, attention_mask=mask, eos_token_id=[eos])
    for r in range(3):
        hits = np.flatnonzero(np.asarray(new[r]) == eos)
        first = int(hits[0]) if len(hits) else 32
        assert np.array_equal(got[r, :first + 1], new[r, :first + 1])
        assert bool((got[r, first:] == eos).all())
    # every row done after its first token: the loop stops, the rest is the pad id
    padded = jax_model(pad_token_id=0, **GQA).generate(x, 32, attention_mask=mask,
                                                       eos_token_id=[int(t) for t in new[:, 0]])
    assert np.array_equal(padded[:, 0], new[:, 0]) and not padded[:, 1:].any()


def test_sampling_is_reproducible_and_top_k_keeps_the_largest():
    m = jax_model(**GQA)
    x, mask = padded_prompts()
    kw = dict(attention_mask=mask, do_sample=True, temperature=0.8, top_k=5, top_p=0.9,
              repetition_penalty=1.2, eos_token_id=None)
    a = m.generate(x, 32, seed=7, **kw)
    assert np.array_equal(a, m.generate(x, 32, rng=jax.random.key(7), **kw))
    assert not np.array_equal(a, m.generate(x, 32, seed=8, **kw))
    # at a very low temperature the sample is the (penalised) argmax
    cold = m.generate(x, 32, seed=1, **{**kw, "temperature": 1e-6})
    greedy = m.generate(x, 32, attention_mask=mask, eos_token_id=None, repetition_penalty=1.2)
    assert np.array_equal(cold, greedy)
    assert not np.array_equal(greedy, m.generate(x, 32, attention_mask=mask, eos_token_id=None))


def test_logits_processing_equals_transformers_processors():
    """process_logits against transformers' own RepetitionPenalty, Temperature, TopK and
    TopP processors on the same logits (and the same tokens seen)."""
    torch = pytest.importorskip("torch")
    from transformers import (LogitsProcessorList, RepetitionPenaltyLogitsProcessor,
                              TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

    from jax_side.decoding import process_logits

    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((4, 64)) * 3).astype(np.float32)
    history = rng.integers(0, 64, (4, 9))
    seen = np.zeros((4, 64), bool)
    np.put_along_axis(seen, history, True, 1)
    for kw in [dict(penalty=1.3), dict(temperature=0.7, top_k=5),
               dict(penalty=0.8, temperature=1.3, top_p=0.6), dict(top_p=0.95, top_k=40)]:
        hf = LogitsProcessorList(
            ([RepetitionPenaltyLogitsProcessor(kw["penalty"])] if "penalty" in kw else [])
            + ([TemperatureLogitsWarper(kw["temperature"])] if "temperature" in kw else [])
            + ([TopKLogitsWarper(kw["top_k"])] if "top_k" in kw else [])
            + ([TopPLogitsWarper(kw["top_p"])] if "top_p" in kw else []))
        want = hf(torch.from_numpy(history), torch.from_numpy(logits)).numpy()
        got = np.asarray(process_logits(jnp.asarray(logits), jnp.asarray(seen), **kw))
        assert np.array_equal(np.isinf(got), np.isinf(want)), kw
        assert 0 < np.isinf(want).sum() < want.size or "top" not in str(kw), kw
        keep = ~np.isinf(want)
        np.testing.assert_allclose(got[keep], want[keep], rtol=1e-6, err_msg=str(kw))


def test_bad_inputs_raise_naming_the_argument():
    m = jax_model()
    x = ids(2, 5, seed=8)
    for kw, name in [(dict(max_new_tokens=-1), "max_new_tokens"),
                     (dict(temperature=0.0), "temperature"), (dict(top_k=0), "top_k"),
                     (dict(top_p=1.5), "top_p"), (dict(repetition_penalty=0), "repetition"),
                     (dict(eos_token_id=64), "eos_token_id"), (dict(pad_token_id=-1), "pad"),
                     (dict(do_sample=1), "do_sample"), (dict(do_sample=True), "rng: sampling")]:
        with pytest.raises(ValueError, match=name):
            m.generate(x, **{"max_new_tokens": 2, **kw})
    right_padded = np.ones((2, 5), np.int32)
    right_padded[0, -1] = 0
    with pytest.raises(ValueError, match="attention_mask: expected .* left padding"):
        m.generate(x, 2, attention_mask=right_padded)
    with pytest.raises(ValueError, match="cu_seqlens"):
        m.generate(x[:1], 2, cu_seqlens=[0, 3, 3, 5])
    with pytest.raises(ValueError, match="input_ids: expected token ids"):
        m(x + 64)
    with pytest.raises(ValueError, match="input_ids: expected an integer"):
        m(x.astype(jnp.float32))
    with pytest.raises(ValueError, match="states: expected a list of 2"):
        m(x, states=[None])
    with pytest.raises(TypeError, match="config: expected a bridge.model_config.GLAConfig"):
        GLAForCausalLM(dict(SMALL), rngs=nnx.Rngs(0))
    params = m.params()
    with pytest.raises(ValueError, match=r"missing \['lm_head.weight'\]"):
        m.load_params({k: v for k, v in params.items() if k != "lm_head.weight"})
    with pytest.raises(ValueError, match=r"model.norm.weight: expected \(32,\)"):
        m.load_params({**params, "model.norm.weight": np.zeros(3, np.float32),
                       "lm_head.weight": np.zeros((64, 32), np.float32)})
    assert np.array_equal(m.params()["lm_head.weight"], params["lm_head.weight"])  # untouched
    auto = (jax.sharding.AxisType.Auto,)
    with pytest.raises(ValueError, match="model_axis: 'model' is not an axis of the mesh"):
        with jax.set_mesh(jax.make_mesh((1,), ("data",), axis_types=auto)):
            GLAForCausalLM(GLAConfig(**SMALL), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="mesh: the model runs under meshes with Auto axes"):
        mesh = jax.make_mesh((1,), ("model",), axis_types=(jax.sharding.AxisType.Explicit,))
        with jax.set_mesh(mesh):
            m(x)


# ---------------------------------------------------------------- sharding
def test_parameters_carry_the_documented_sharding_specs():
    specs = {n: tuple(v.get_metadata()["out_sharding"])
             for n, v in named_params(jax_model()).items()}
    assert specs["model.embeddings.weight"] == ("model", None)
    assert specs["lm_head.weight"] == ("model", None)
    for n in ("q_proj", "k_proj", "v_proj", "g_proj", "gk_proj.1"):
        assert specs[f"model.layers.1.attn.{n}.weight"] == ("model", None), n
    assert specs["model.layers.1.attn.gk_proj.1.bias"] == ("model",)
    assert specs["model.layers.1.attn.gk_proj.0.weight"] == (None, None)
    assert specs["model.layers.1.attn.o_proj.weight"] == (None, "model")
    assert specs["model.layers.1.mlp.up_proj.weight"] == ("model", None)
    assert specs["model.layers.1.mlp.down_proj.weight"] == (None, "model")
    assert specs["model.layers.1.attn.g_norm_swish_gate.weight"] == (None,)
    assert specs["model.norm.weight"] == (None,)
    other = GLAForCausalLM(GLAConfig(**SMALL), rngs=nnx.Rngs(0), model_axis="tp")
    spec = nnx.get_partition_spec(nnx.state(other))
    assert spec["model"]["layers"][0]["mlp"]["down_proj"]["weight"].get_value() == \
        jax.sharding.PartitionSpec(None, "tp")


def test_training_step_on_a_data_x_model_mesh_equals_one_device():
    """A jitted SGD step with parameters sharded by their specs over "model" and the
    batch over "data" (2 x 2 host devices, a subprocess: the device count is fixed
    before jax starts) equals the step on one device: loss, gradients, new parameters."""
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    env = dict(os.environ, XLA_FLAGS=flags.strip(),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, __file__], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert {r["name"] for r in rows} >= {"loss", "grads", "params", "sharded"}, rows
    bad = [r for r in rows if not r["err"] <= r["tol"]]
    assert not bad, bad


def _mesh_step_cases():
    """The subprocess of the test above: prints one JSON line per check."""
    import tempfile

    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    assert jax.device_count() == 4, jax.devices()
    x = ids(4, 10, seed=11)
    ref = jax_model()
    graphdef, _ = nnx.split(ref)

    @jax.jit
    def train_step(state, x):
        loss, grads = jax.value_and_grad(lambda s: nnx.merge(graphdef, s).loss(x))(state)
        return loss, grads, jax.tree.map(lambda p, g: p - 0.5 * g, state, grads)

    def report(name, err, tol):
        print(json.dumps(dict(name=name, err=float(err), tol=tol)), flush=True)

    want = train_step(nnx.state(ref), x)  # one device: everything committed to device 0
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    with tempfile.TemporaryDirectory() as d, jax.set_mesh(mesh):
        ref.save_pretrained(d)
        model = GLAForCausalLM.from_pretrained(d)  # placed by the specs
        got = train_step(nnx.state(model), jax.device_put(x, NamedSharding(mesh, P("data"))))
    report("loss", rel_err(got[0], want[0]), 1e-5)
    for i, name in ((1, "grads"), (2, "params")):
        # (the Params' metadata differs: eager placement on the mesh only)
        errs = [rel_err(a, b) for a, b in zip(jax.tree.leaves(got[i]), jax.tree.leaves(want[i]),
                                              strict=True)]
        report(name, max(errs), 2e-5)
    # the sharding held: q_proj's rows and o_proj's columns over "model", in and out
    attn = lambda s: s["model"]["layers"][0]["attn"]  # noqa: E731
    specs = [attn(s)[n]["weight"][...].sharding.spec for s in (nnx.state(model), got[1], got[2])
             for n in ("q_proj", "o_proj")]
    ok = specs == [P("model", None), P(None, "model")] * 3
    report("sharded", 0.0 if ok else 1.0, 0.0)


if __name__ == "__main__":
    _mesh_step_cases()
