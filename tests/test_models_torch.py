"""The PyTorch GLA language model (torch_side/models.py) and its checkpoints
(bridge/checkpoint.py): against flash-linear-attention's own GLAForCausalLM, against its
own full-sequence forward (prefill + decode through transformers' cache, batched prompts,
greedy generation), and
trained under torch.compile and DDP against eager and one process.

fla's model runs here on CPU: its Triton kernels under the interpreter (TRITON_INTERPRET=1,
set by bridge.kernels on a machine without a GPU), with Triton's autotuner timer replaced
(it asks for a GPU driver to time configs); fla runs its fused_recurrent kernel for
T <= 64, so the sequences stay that short (its chunk kernels fail in the interpreter)."""

import json
import os

import numpy as np
import pytest
import torch
from transformers import DynamicCache

import bridge.kernels  # noqa: F401  (decides on Triton's interpreter before triton loads)
from bridge import checkpoint
from bridge.model_config import GLAConfig, model_param_shapes
from parity import spawn
from parity.compare import rel_err
from torch_side.models import GLAForCausalLM, causal_lm_loss

TOL = 1e-5  # float32, relative (the bar against fla)
SMALL = dict(hidden_size=32, num_heads=2, num_hidden_layers=2, vocab_size=64,
             intermediate_size=48, initializer_range=0.2)
# defaults (fla's g_norm_swish_gate); kv groups, tied head, clamped gates, a feature map
# that moves 0 (so padding must be masked after it), no output gate (fla's g_norm)
CONFIGS = {
    "default": dict(),
    "gqa_tied_clamp_sigmoid": dict(num_kv_heads=1, tie_word_embeddings=True, clamp_min=-0.05,
                                   feature_map="sigmoid", use_output_gate=False),
}


def _randomize(model, seed):
    """Norm weights and gate biases away from their 1 / 0 init, so both are tested."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)


def ours(name="default", seed=0, **kw):
    torch.manual_seed(seed)
    m = GLAForCausalLM(GLAConfig(**SMALL, **CONFIGS[name], **kw))
    _randomize(m, seed + 100)
    return m.eval()


def ids(B, T, seed, V=64):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- fidelity to fla
@pytest.fixture
def fla_model(monkeypatch):
    """fla's GLAConfig / GLAForCausalLM, runnable on CPU tensors (module docstring)."""
    pytest.importorskip("fla", reason="flash-linear-attention (the fidelity anchor) is "
                                      "not installed: pip install -e '.[test]'")
    import triton.runtime.autotuner as autotuner
    from fla.models import GLAConfig as FlaConfig
    from fla.models import GLAForCausalLM as FlaModel

    if os.environ.get("TRITON_INTERPRET") == "1":  # nothing to time configs on
        monkeypatch.setattr(autotuner.Autotuner, "do_bench",
                            property(lambda self: lambda fn, quantiles=None: [0.0] * 3))
    return FlaConfig, FlaModel


@pytest.mark.parametrize("name", CONFIGS)
def test_fla_checkpoint_loads_strictly_and_logits_match_fla(name, fla_model, tmp_path):
    """fla's model (random weights) -> fla's save_pretrained -> ours: the same logits as
    fla's own forward, unpadded and left-padded; ours -> save_pretrained -> fla loads
    strictly and computes the same logits."""
    FlaConfig, FlaModel = fla_model
    torch.manual_seed(1)
    fla = FlaModel(FlaConfig(**SMALL, **CONFIGS[name])).float().eval()
    _randomize(fla, 2)
    fla.save_pretrained(tmp_path / "fla")
    model = GLAForCausalLM.from_pretrained(tmp_path / "fla")
    assert set(model.state_dict()) == set(fla.state_dict())

    x = ids(2, 40, seed=3)
    mask = torch.ones_like(x)
    mask[1, :13] = 0  # the second prompt left-padded
    with torch.no_grad():
        want = fla(x).logits
        want_pad = fla(x, attention_mask=mask).logits
        got, got_pad = model(x).logits, model(x, attention_mask=mask).logits
    assert rel_err(got, want) <= TOL, rel_err(got, want)
    assert rel_err(got_pad[mask.bool()], want_pad[mask.bool()]) <= TOL

    model.save_pretrained(tmp_path / "ours", max_shard_size="20KB")  # sharded
    assert (tmp_path / "ours" / checkpoint.INDEX).is_file()
    back, info = FlaModel.from_pretrained(tmp_path / "ours", output_loading_info=True)
    assert not any(info.values()), info
    with torch.no_grad():
        assert torch.equal(back.float()(x).logits, want)


# ---------------------------------------------------------------- checkpoints
def test_checkpoint_round_trips_exactly_single_sharded_and_bf16(tmp_path):
    m = ours("gqa_tied_clamp_sigmoid")
    m.save_pretrained(tmp_path / "one")
    m.save_pretrained(tmp_path / "many", max_shard_size=4000)
    files = sorted(os.listdir(tmp_path / "many"))
    assert checkpoint.WEIGHTS not in files and len(files) > 3
    index = json.loads((tmp_path / "many" / checkpoint.INDEX).read_text())
    assert set(index["weight_map"]) == set(model_param_shapes(m.config))
    assert "lm_head.weight" not in index["weight_map"]  # tied: written once, as fla does
    for d in ("one", "many"):
        back = GLAForCausalLM.from_pretrained(tmp_path / d)
        assert back.config == m.config and back.lm_head.weight is back.model.embeddings.weight
        for k, v in m.state_dict().items():
            assert torch.equal(back.state_dict()[k], v), (d, k)

    m.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    _, arrays = checkpoint.load_pretrained(tmp_path / "bf16")  # NumPy, as JAX reads it
    assert str(arrays["model.norm.weight"].dtype) == "bfloat16"
    back = GLAForCausalLM.from_pretrained(tmp_path / "bf16")
    assert back.model.norm.weight.dtype == torch.bfloat16
    for k, v in m.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


def test_checkpoint_errors_name_the_problem(tmp_path):
    m = ours()
    m.save_pretrained(tmp_path / "ok")
    params = {k: v.numpy() for k, v in m.params().items()}
    cfg = m.config
    partial = {k: v for k, v in params.items() if k != "lm_head.weight"}
    with pytest.raises(ValueError, match=r"missing \['lm_head.weight'\], unexpected \['x'\]"):
        checkpoint.check_model_params({**partial, "x": params["model.norm.weight"]}, cfg)
    with pytest.raises(ValueError, match=r"model.norm.weight: expected \(32,\)"):
        checkpoint.check_model_params({**params, "model.norm.weight": np.zeros(3)}, cfg)
    with pytest.raises(ValueError, match="int64"):
        checkpoint.check_model_params({**params, "model.norm.weight": np.zeros(32, int)}, cfg)
    # a config of another shape against these weights: the strict load refuses
    other = GLAConfig(**{**SMALL, "num_kv_heads": 1})
    checkpoint.write_weights(tmp_path / "other", params)
    (tmp_path / "other" / "config.json").write_text(other.to_json())
    with pytest.raises(ValueError, match="k_proj.weight: expected"):
        GLAForCausalLM.from_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match="only safetensors"):
        (tmp_path / "pickle").mkdir()
        (tmp_path / "pickle" / "pytorch_model.bin").write_bytes(b"")
        (tmp_path / "pickle" / "config.json").write_text(cfg.to_json())
        GLAForCausalLM.from_pretrained(tmp_path / "pickle")
    (tmp_path / "nothing").mkdir()
    with pytest.raises(ValueError, match="config.json"):
        GLAForCausalLM.from_pretrained(tmp_path / "nothing")
    checkpoint.write_weights(tmp_path / "both", params, max_shard_size="10KB")
    single = (tmp_path / "ok" / checkpoint.WEIGHTS).read_bytes()
    (tmp_path / "both" / checkpoint.WEIGHTS).write_bytes(single)
    with pytest.raises(ValueError, match="both"):
        checkpoint.read_weights(tmp_path / "both")
    with pytest.raises(ValueError, match="max_shard_size"):
        checkpoint.write_weights(tmp_path / "x", params, max_shard_size="lots")


@pytest.mark.parametrize("option,value", [
    ("use_short_conv", True), ("attn", {"layers": [0], "num_heads": 2}),
    ("attnres_block_size", 2), ("use_l2warp", True), ("elementwise_affine", False),
    ("hidden_act", "powlu"), ("feature_map", "elu"), ("clamp_min", 0.5),
    ("attn_mode", "parallel"), ("num_kv_heads", 3),
])
def test_unsupported_fla_options_raise_naming_the_option(option, value):
    d = {**GLAConfig(**SMALL).to_dict(), option: value, "transformers_version": "5.24.0"}
    with pytest.raises(ValueError, match=f"^{option}"):
        GLAConfig.from_dict(d)
    with pytest.raises(ValueError, match="model_type"):
        GLAConfig.from_dict({"model_type": "llama"})


# ---------------------------------------------------------------- decoding
def test_prefill_then_decode_through_the_transformers_cache_equals_the_full_forward():
    m = ours("gqa_tied_clamp_sigmoid")
    x = ids(2, 12, seed=4)
    cache = DynamicCache(config=m.config)  # one linear-attention layer per block
    with torch.no_grad():
        full = m(x, use_cache=False).logits
        out = m(x[:, :5], cache=cache)  # the prompt: one call per layer
        steps = [out.logits]
        for t in range(5, 12):  # then one recurrent step per token, states in place
            steps.append(m(x[:, t:t + 1], cache=out.cache).logits)
    assert out.cache is cache and len(cache.layers) == m.config.num_hidden_layers
    assert cache.layers[0].recurrent_states[0].shape == m.config.layer.state_shape(2)
    assert rel_err(torch.cat(steps, 1), full) < 2e-5


def _greedy_by_full_forwards(m, prompt, n):
    seq = prompt
    with torch.no_grad():
        for _ in range(n):
            nxt = m(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
    return seq[:, prompt.shape[1]:]


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_generate_equals_argmax_of_full_forwards(name):
    m = ours(name)
    prompt = ids(2, 6, seed=5)
    got = m.generate(prompt, max_new_tokens=8, eos_token_id=None, pad_token_id=0)
    assert got.shape == (2, 14) and torch.equal(got[:, :6], prompt)
    assert torch.equal(got[:, 6:], _greedy_by_full_forwards(m, prompt, 8))


def test_mixed_length_prompts_left_padded_or_packed_equal_one_by_one():
    m = ours("gqa_tied_clamp_sigmoid")
    prompts = [ids(1, n, seed=10 + n) for n in (7, 3, 5)]
    kw = dict(max_new_tokens=6, eos_token_id=None, pad_token_id=9)
    one_by_one = torch.cat([m.generate(p, **kw)[:, -6:] for p in prompts])
    T = 7
    padded = torch.full((3, T), 9)  # padding holds real token ids: the mask must hide them
    mask = torch.zeros(3, T, dtype=torch.long)
    for i, p in enumerate(prompts):
        padded[i, T - p.shape[1]:], mask[i, T - p.shape[1]:] = p[0], 1
    assert torch.equal(m.generate(padded, attention_mask=mask, **kw)[:, T:], one_by_one)
    # the prompt's last logits agree too (not only their argmax), packed as well
    packed = torch.cat(prompts, 1)
    cu = torch.tensor([0, 7, 10, 15])
    with torch.no_grad():
        pad_last = m(padded, attention_mask=mask).logits[:, -1]
        packed_last = m(packed, cu_seqlens=cu).logits[0, cu[1:] - 1]
        single = torch.cat([m(p).logits[:, -1] for p in prompts])
    assert rel_err(pad_last, single) < 2e-5 and rel_err(packed_last, single) < 2e-5


def test_bad_forward_inputs_raise():
    m = ours()
    x = ids(2, 5, seed=8)
    with pytest.raises(ValueError, match="input_ids: expected token ids"):
        m(x + 64)
    with pytest.raises(ValueError, match="input_ids: expected an integer"):
        m(x.float())
    with pytest.raises(TypeError, match="cache: expected a transformers Cache"):
        m(x, cache=[None, None])
    with pytest.raises(TypeError, match="config: expected a bridge.model_config.GLAConfig"):
        GLAForCausalLM(dict(SMALL))
    with pytest.raises(ValueError, match="not a local directory"):
        GLAForCausalLM.from_pretrained("fla-hub/gla-1.3B-100B")
    with pytest.raises(TypeError, match="unsupported arguments"):
        GLAForCausalLM.from_pretrained(".", device_map="auto")


# ---------------------------------------------------------------- training
def test_compiled_training_step_equals_eager():
    """torch.compile(fullgraph=True) of the loss (dynamo graph; AOT autograd's forward
    and backward, aot_eager: no C++ build) against eager: loss and every gradient."""
    m = ours("gqa_tied_clamp_sigmoid").train()
    x = ids(2, 10, seed=9)
    loss = m.loss(x)
    loss.backward()
    want = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    compiled = torch.compile(m.loss, fullgraph=True, backend="aot_eager")
    got_loss = compiled(x)
    got_loss.backward()
    assert rel_err(got_loss.detach(), loss.detach()) < 1e-6
    for n, p in m.named_parameters():
        assert rel_err(p.grad, want[n]) < 2e-5, n
    # and an optimizer step decreases the loss
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    opt.step()
    assert compiled(x).item() < loss.item()


def _ddp_worker(rank, world):
    from torch.nn.parallel import DistributedDataParallel

    x = ids(4, 10, seed=11)
    ref = ours("gqa_tied_clamp_sigmoid").train()
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    ref.loss(x).backward()  # one process, the whole batch
    opt.step()

    dp = ours("gqa_tied_clamp_sigmoid").train()
    ddp = DistributedDataParallel(dp)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
    mine = x[2 * rank:2 * rank + 2]  # DDP averages the ranks' half-batch gradients
    causal_lm_loss(ddp(mine).logits, mine).backward()
    opt.step()
    for (n, a), b in zip(ref.named_parameters(), dp.parameters()):
        assert rel_err(b.detach(), a.detach()) < 2e-6, (rank, n)
    # and not what this rank's half alone gives: the ranks' gradients were averaged
    alone = ours("gqa_tied_clamp_sigmoid").train()
    opt = torch.optim.SGD(alone.parameters(), lr=0.5)
    alone.loss(mine).backward()
    opt.step()
    emb = lambda m: m.model.embeddings.weight.detach()  # noqa: E731
    assert rel_err(emb(alone), emb(dp)) > 1e-3


def test_ddp_step_on_two_gloo_ranks_equals_one_process():
    spawn.gloo(_ddp_worker, 2, timeout_s=240)
