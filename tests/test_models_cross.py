"""The JAX GLA model (jax_side/models.py) against the PyTorch one (torch_side/models.py)
and flash-linear-attention's own: one checkpoint directory, the same logits (fp32 and
bf16), the same greedy tokens for 32 steps from mixed-length prompts (left-padded and
packed, against torch's one-by-one runs of transformers' generate, with and without a
repetition penalty), the same training gradients, and checkpoints
written by JAX loading strictly into torch and fla.

fla's model runs on CPU as in test_models_torch.py (its fixture: interpreted Triton
kernels, T <= 64); the torch model is itself checked against fla and against its own
one-by-one generation there."""

import numpy as np
import pytest
import torch

import bridge.kernels  # noqa: F401  (decides on Triton's interpreter before triton loads)
import jax
import jax.numpy as jnp
from flax import nnx

from jax_side.layers import FEATURE_MAPS as JAX_MAPS
from jax_side.models import GLAForCausalLM as JaxLM
from parity import models as parity_models
from parity.__main__ import main as parity_main
from parity.compare import rel_err
from parity.models import jax_forward as forward  # one compile per shape, shared
from test_models_torch import CONFIGS, SMALL, TOL, fla_model, ids, ours  # noqa: F401 (fixture)
from torch_side.layers import FEATURE_MAPS as TORCH_MAPS
from torch_side.models import GLAForCausalLM as TorchLM

def load_jax(path):
    """JaxLM.from_pretrained on the XLA path, named as parity --model names it (the
    platform is part of the jitted model's structure: same name, shared compiles)."""
    return JaxLM.from_pretrained(path, platform="xla")


def to_jax(t):
    return jnp.asarray(t.numpy())


def batch():
    """Tokens [2, 16], the second row left-padded by 5 (padding holds real ids)."""
    x = ids(2, 16, seed=3)
    mask = torch.ones_like(x)
    mask[1, :5] = 0
    return x, mask


@pytest.mark.parametrize("name", CONFIGS)
def test_torch_checkpoint_gives_the_same_logits_in_jax_and_back(name, tmp_path):
    m = ours(name)
    m.save_pretrained(tmp_path / "torch")
    j = load_jax(tmp_path / "torch")  # safetensors -> NumPy -> jax
    x, mask = batch()
    with torch.no_grad():
        want = m(x, attention_mask=mask).logits
    got = forward(j, to_jax(x), to_jax(mask))
    keep = mask.bool().numpy()
    assert rel_err(np.asarray(got)[keep], want.numpy()[keep]) <= TOL

    j.save_pretrained(tmp_path / "jax", max_shard_size="20KB")  # sharded, as fla's layout
    back = TorchLM.from_pretrained(tmp_path / "jax")
    for k, v in m.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    # in memory too: the torch model's tensors (DLPack) into a JAX model, exactly
    other = load_jax(tmp_path / "jax")
    other.load_params({n: p * 2 for n, p in m.params().items()})
    for n, p in other.params().items():
        assert np.array_equal(np.asarray(p), m.params()[n].detach().numpy() * 2), n


@pytest.mark.parametrize("name", CONFIGS)
def test_fla_checkpoint_gives_fla_logits_in_jax_and_jax_checkpoint_loads_into_fla(
        name, fla_model, tmp_path):  # noqa: F811 (the fixture imported above)
    FlaConfig, FlaModel = fla_model
    torch.manual_seed(1)
    fla = FlaModel(FlaConfig(**SMALL, **CONFIGS[name])).float().eval()
    with torch.no_grad():  # norms and gate biases away from their init
        g = torch.Generator().manual_seed(2)
        for n, p in fla.named_parameters():
            if "norm" in n or n.endswith(".bias"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
    fla.save_pretrained(tmp_path / "fla")
    j = load_jax(tmp_path / "fla")
    x, mask = batch()
    with torch.no_grad():
        want = fla(x, attention_mask=mask).logits
    got = forward(j, to_jax(x), to_jax(mask))
    keep = mask.bool().numpy()
    assert rel_err(np.asarray(got)[keep], want.numpy()[keep]) <= TOL

    j.save_pretrained(tmp_path / "jax")
    back, info = FlaModel.from_pretrained(tmp_path / "jax", output_loading_info=True)
    assert not any(info.values()), info
    with torch.no_grad():
        assert torch.equal(back.float()(x, attention_mask=mask).logits, want)


def test_bf16_checkpoint_agrees_within_bf16_rounding(tmp_path):
    """bf16 weights and compute in both frameworks: each within bf16 rounding of the fp32
    model, and of each other."""
    m = ours()
    x, mask = batch()
    keep = mask.bool().numpy()
    with torch.no_grad():
        ref = m(x, attention_mask=mask).logits.numpy()[keep]
        m.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
        want = m(x, attention_mask=mask).logits.float().numpy()[keep]
    j = load_jax(tmp_path / "bf16")
    assert j.model.dtype == jnp.bfloat16
    got = np.asarray(forward(j, to_jax(x), to_jax(mask)).astype(jnp.float32))[keep]
    torch_err, jax_err = rel_err(want, ref), rel_err(got, ref)
    assert 1e-4 < torch_err < 3e-2 and jax_err < 3e-2, (torch_err, jax_err)
    assert rel_err(got, want) < 3e-2


def test_greedy_tokens_of_mixed_length_prompts_equal_torch_one_by_one(tmp_path):
    """32 greedy tokens from prompts of lengths 7, 3, 5: JAX left-padded and JAX packed
    equal torch's (transformers' generate) one-by-one runs token for token; with a
    repetition penalty too (packed: each prompt's own tokens penalised, as one by one)."""
    m = ours("gqa_tied_clamp_sigmoid", seed=3)  # a seed whose tokens do not loop at once
    m.save_pretrained(tmp_path / "m")
    j = load_jax(tmp_path / "m")
    prompts = [ids(1, n, seed=10 + n) for n in (7, 3, 5)]
    kw = dict(max_new_tokens=32, eos_token_id=None, pad_token_id=0)
    want = torch.cat([m.generate(p, **kw)[:, -32:] for p in prompts]).numpy()
    assert len(np.unique(want)) > 8  # not a constant stream: the comparison has teeth
    T = 7
    padded = torch.full((3, T), 9)
    mask = torch.zeros(3, T, dtype=torch.long)
    for i, p in enumerate(prompts):
        padded[i, T - p.shape[1]:], mask[i, T - p.shape[1]:] = p[0], 1
    got = j.generate(to_jax(padded), 32, attention_mask=to_jax(mask), eos_token_id=None)
    assert np.array_equal(np.asarray(got), want)
    packed, cu = to_jax(torch.cat(prompts, 1)), [0, 7, 10, 15]
    assert np.array_equal(np.asarray(j.generate(packed, 32, cu_seqlens=cu, eos_token_id=None)),
                          want)
    penalised = torch.cat([m.generate(p, repetition_penalty=1.3, **kw)[:, -32:]
                           for p in prompts]).numpy()
    assert not np.array_equal(penalised, want)
    got = j.generate(packed, 32, cu_seqlens=cu, eos_token_id=None, repetition_penalty=1.3)
    assert np.array_equal(np.asarray(got), penalised)


def test_jitted_training_step_gradients_equal_torch(tmp_path):
    """jax.jit of loss and gradients against torch autograd on the same weights, then
    an SGD step lowers the loss."""
    m = ours("gqa_tied_clamp_sigmoid").train()
    x = ids(2, 10, seed=9)
    loss = m.loss(x)
    loss.backward()
    m.save_pretrained(tmp_path / "m")
    j = load_jax(tmp_path / "m")
    graphdef, state = nnx.split(j)
    value_and_grad = jax.jit(jax.value_and_grad(lambda s, x: nnx.merge(graphdef, s).loss(x)))
    got, grads = value_and_grad(state, to_jax(x))
    assert rel_err(got, loss.detach()) < 1e-6
    flat = {".".join(map(str, k)): v.get_value() for k, v in nnx.to_flat_state(grads)}
    named = dict(m.named_parameters())  # the tied lm_head is the embedding: one entry
    assert set(flat) == set(named)
    for n, p in named.items():
        assert rel_err(flat[n], p.grad) < 2e-5, n
    new = jax.tree.map(lambda p, g: p - 0.5 * g, state, grads)
    assert float(value_and_grad(new, to_jax(x))[0]) < float(got)


def test_one_config_class_and_the_same_names_in_both_frameworks():
    import jax_side
    import torch_side
    from bridge.model_config import GLAConfig

    assert jax_side.GLAConfig is torch_side.GLAConfig is GLAConfig
    assert (jax_side.GLAForCausalLM, torch_side.GLAForCausalLM) == (JaxLM, TorchLM)
    assert jax_side.GLAModel.__name__ == torch_side.GLAModel.__name__ == "GLAModel"


def test_feature_maps_agree_elementwise():
    x = np.linspace(-6, 6, 97, dtype=np.float32)
    assert set(JAX_MAPS) == set(TORCH_MAPS)
    for name in JAX_MAPS:
        want = TORCH_MAPS[name](torch.from_numpy(x)).numpy()
        assert rel_err(JAX_MAPS[name](jnp.asarray(x)), want) < 1e-6, name


def test_parity_model_reports_agreement_and_a_wrong_backend(capsys):
    """`python -m parity --model`'s comparison (the GQA config and shapes of the tests
    above, so its JAX compiles are theirs): torch agrees with the float64 model; JAX
    with one weight off by 1% is reported, against the float64 model and torch."""
    def params_for(name, params):
        if name != "jax-xla":
            return params
        return {**params, "model.norm.weight": params["model.norm.weight"] * 1.01}

    backends = [parity_models.ModelBackend(n) for n in ("torch-torch", "jax-xla")]
    rows = parity_models.compare(backends, ("gqa-tied-clamp-sigmoid",), dtypes=("float32",),
                                 params_for=params_for)
    by = {(r["backend"], r["against"]): r for r in rows}
    assert by["torch-torch", "float64"]["ok"] and by["torch-torch", "float64"]["tokens"] == 96
    assert not by["jax-xla", "float64"]["ok"] and by["jax-xla", "float64"]["err"] > 1e-3
    assert not by["torch-torch", "jax-xla"]["ok"]
    text = parity_models.table(rows)
    assert "torch-torch vs jax-xla" in text and "FAIL" in text
    for argv in (["--model", "--backends", "torch-nope"], ["--model", "--cases", "nope"]):
        with pytest.raises(SystemExit) as e:
            parity_main(argv)
        assert e.value.code == 2
