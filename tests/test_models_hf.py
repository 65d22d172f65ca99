"""The PyTorch GLA model as transformers users use it (torch_side/models.py,
bridge/model_config.py): `generate` through transformers' cache against transformers' own
decoding of the same model without a cache (each step's logits from the full sequence:
greedy, eos, beam search, sampling with a fixed seed, a streamer), `pipeline
("text-generation")` with a byte-level BPE tokenizer built offline, both fla-hub config
spellings, the Auto classes with and without fla imported (subprocesses: registrations
are process-wide, and test_models_torch.py imports fla), and a torch.compile'd decode
step through the cache against eager."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache, PreTrainedTokenizerFast, pipeline
from transformers.generation.streamers import BaseStreamer

import bridge.kernels  # noqa: F401  (decides on Triton's interpreter before triton loads)
from bridge import checkpoint
from bridge.model_config import GLAConfig
from parity.compare import rel_err
from test_models_torch import SMALL, ids, ours
from torch_side.models import GLAForCausalLM

ROOT = Path(__file__).resolve().parents[1]
TEXT = ("the cat sat on the mat. the dog sat on the log. a cat and a dog met on a mat "
        "by the log, and the cat said to the dog: sit.")


def left_padded():
    x = ids(2, 6, seed=21)
    mask = torch.ones_like(x)
    mask[1, :2] = 0
    return x, mask


class Collect(BaseStreamer):
    """A streamer keeping what generate streams (the prompt first, then each token)."""

    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.reshape(-1))

    def end(self):
        self.ended = True


def test_generate_through_the_cache_equals_transformers_decoding_without_it():
    """Each decoding mode of transformers' generate, with our recurrent cache (one
    chunked prompt call, then one recurrent step per token) and without a cache
    (transformers re-runs the whole sequence through the chunked forward each step):
    the same tokens, left padding included."""
    m = ours("gqa_tied_clamp_sigmoid", seed=3)
    x, mask = left_padded()
    common = dict(attention_mask=mask, max_new_tokens=10, pad_token_id=0)
    greedy = m.generate(x, eos_token_id=None, **common)
    eos = int(greedy[0, 8])  # a token row 0 emits: that row stops there
    cases = {"greedy": dict(eos_token_id=None), "eos": dict(eos_token_id=eos),
             "beam": dict(num_beams=4, num_return_sequences=2, eos_token_id=None),
             "sample": dict(do_sample=True, top_p=0.9, top_k=20, temperature=0.8,
                            repetition_penalty=1.1, eos_token_id=None)}
    outputs = {}
    for name, kw in cases.items():
        torch.manual_seed(5)
        got = m.generate(x, **common, **kw)
        torch.manual_seed(5)
        want = m.generate(x, use_cache=False, **common, **kw)
        assert torch.equal(got, want), name
        outputs[name] = got[:, 6:]
    assert torch.equal(outputs["greedy"], greedy[:, 6:])
    assert (outputs["eos"][0, 3:] == 0).all() and outputs["eos"][0, 2] == eos
    assert outputs["beam"].shape == (4, 10) and not torch.equal(outputs["sample"], greedy[:, 6:])

    streamer = Collect()
    one = m.generate(x[:1], streamer=streamer, eos_token_id=None, max_new_tokens=5)
    assert streamer.ended and torch.equal(torch.cat(streamer.chunks), one[0])


def _tokenizer(directory, vocab_size):
    """A byte-level BPE tokenizer trained on TEXT (tokenizers, offline), saved for
    AutoTokenizer: <pad> 0, <s> 1, </s> 2 (GLAConfig's bos / eos defaults)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>")
    fast.save_pretrained(directory)
    return fast


def _checkpoint(directory):
    """A small model and its tokenizer in one directory, as a hub checkpoint holds them."""
    torch.manual_seed(0)
    model = GLAForCausalLM(GLAConfig(**{**SMALL, "vocab_size": 300}, pad_token_id=0)).eval()
    model.save_pretrained(directory)
    return model, _tokenizer(directory, 300)


def test_pipeline_text_generation_equals_generate_and_decode(tmp_path):
    model, tok = _checkpoint(tmp_path)
    assert len(tok) <= model.config.vocab_size
    pipe = pipeline("text-generation", model=model, tokenizer=tok)
    text = pipe("the cat", max_new_tokens=8, do_sample=False)[0]["generated_text"]
    inputs = tok("the cat", return_tensors="pt")
    tokens = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    assert tokens.shape[1] > inputs["input_ids"].shape[1]
    assert text == tok.decode(tokens[0], skip_special_tokens=True) and text.startswith("the cat")


def test_both_fla_hub_config_spellings_load(tmp_path):
    """The newer spelling (attn_mode "chunk", norm_eps, use_output_gate) and the older
    (attn_mode "fused_chunk", rms_norm_eps, no norm_eps, torch_dtype) load the same
    weights; the old one's rms_norm_eps is the norms' epsilon."""
    m = ours()
    m.save_pretrained(tmp_path / "new")
    new = json.loads((tmp_path / "new" / "config.json").read_text())
    assert new["attn_mode"] == "chunk" and "norm_eps" in new and new["use_output_gate"]
    old = {k: v for k, v in new.items() if k not in ("norm_eps", "use_output_gate", "dtype")}
    old.update(attn_mode="fused_chunk", rms_norm_eps=1e-2, torch_dtype="float32",
               transformers_version="4.40.2", share_conv_kernel=True)
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "config.json").write_text(json.dumps(old))
    os.link(tmp_path / "new" / checkpoint.WEIGHTS, tmp_path / "old" / checkpoint.WEIGHTS)

    a = GLAForCausalLM.from_pretrained(tmp_path / "new")
    b = GLAForCausalLM.from_pretrained(tmp_path / "old")
    assert a.config == m.config and GLAConfig.from_pretrained(tmp_path / "new") == m.config
    assert b.config.norm_eps == 1e-2 and b.config.attn_mode == "fused_chunk"
    assert GLAConfig.from_pretrained(tmp_path / "old") == b.config
    want = GLAForCausalLM(GLAConfig(**{**SMALL, "norm_eps": 1e-2}))
    want.load_params(m.params())
    x = ids(2, 9, seed=22)
    with torch.no_grad():
        assert rel_err(b(x).logits, want(x).logits) < 1e-6
        assert rel_err(a(x).logits, m(x).logits) == 0 and rel_err(b(x).logits, m(x).logits) > 1e-4
    with pytest.raises(ValueError, match="rms_norm_eps: .* disagrees with norm_eps"):
        GLAConfig.from_dict({**old, "norm_eps": 1e-3})


# the Auto classes in a fresh process: `order` imports torch_side and fla (or not) in turn
AUTO = """
import json, sys
import bridge.kernels  # Triton's interpreter on a machine without a GPU, before fla
order, path, fla_path = sys.argv[1].split(","), sys.argv[2], sys.argv[3]
for name in order:
    __import__(name)
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, pipeline
from bridge.model_config import register_auto_config
from torch_side import GLAForCausalLM

config, model = AutoConfig.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
ours = GLAForCausalLM.from_pretrained(path)  # ours whatever is registered
x = torch.tensor([[5, 17, 3, 99]])
out = {"config": type(config).__module__, "model": type(model).__module__,
       "fla": "fla" in sys.modules, "registered": register_auto_config(),
       "ours": ours.generate(x, max_new_tokens=6, do_sample=False).tolist()}
if not out["fla"]:
    out["auto"] = model.generate(x, max_new_tokens=6, do_sample=False).tolist()
    fla_written = AutoModelForCausalLM.from_pretrained(fla_path)  # a directory fla wrote
    out["fla_dir"] = [type(fla_written).__module__, "fla" in sys.modules,
                      fla_written.generate(x, max_new_tokens=6, do_sample=False).tolist()]
    pipe = pipeline("text-generation", model=path)  # model and tokenizer from the directory
    out["pipe"] = pipe("the cat", max_new_tokens=8, do_sample=False)[0]["generated_text"]
print("RESULT", json.dumps(out))
"""


def _auto(orders, path, fla_path):
    """AUTO's results for each import order, the processes run side by side."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    runs = [subprocess.Popen([sys.executable, "-c", AUTO, ",".join(order), str(path),
                              str(fla_path)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
            for order in orders]
    out = []
    for run in runs:
        stdout, stderr = run.communicate(timeout=300)
        assert run.returncode == 0, stderr[-3000:]
        out.append(json.loads(stdout.split("RESULT ", 1)[1]))
    return out


def test_auto_classes_serve_ours_without_fla_and_fla_with_it(tmp_path):
    """Without fla: AutoConfig / AutoModelForCausalLM / pipeline(path) give ours, the same
    tokens as ours in this process, and a directory fla wrote loads into ours without
    importing fla. With fla imported, before or after torch_side: fla's
    classes serve "gla" (fla registers over any holder; we never replace one), and our
    GLAForCausalLM.from_pretrained still loads the directory."""
    pytest.importorskip("fla", reason="flash-linear-attention (the fidelity anchor) is not "
                                      "installed: pip install -e '.[test]'")
    from fla.models import GLAConfig as FlaConfig
    from fla.models import GLAForCausalLM as FlaModel

    torch.manual_seed(1)
    FlaModel(FlaConfig(**{**SMALL, "vocab_size": 300})).save_pretrained(tmp_path / "fla")
    x = torch.tensor([[5, 17, 3, 99]])
    want_fla = GLAForCausalLM.from_pretrained(tmp_path / "fla").generate(
        x, max_new_tokens=6, do_sample=False).tolist()
    model, tok = _checkpoint(tmp_path / "ours")
    want = model.generate(x, max_new_tokens=6, do_sample=False).tolist()
    pipe = pipeline("text-generation", model=model, tokenizer=tok)
    text = pipe("the cat", max_new_tokens=8, do_sample=False)[0]["generated_text"]

    orders = (["torch_side", "fla"], ["fla", "torch_side"])
    alone, *with_fla = _auto([["torch_side"], *orders], tmp_path / "ours", tmp_path / "fla")
    assert alone["config"] == "bridge.model_config" and alone["model"] == "torch_side.models"
    assert not alone["fla"] and alone["registered"]
    assert alone["auto"] == want and alone["ours"] == want and alone["pipe"] == text
    assert alone["fla_dir"] == ["torch_side.models", False, want_fla]
    for order, both in zip(orders, with_fla):
        assert both["fla"] and not both["registered"], order
        assert both["config"].startswith("fla.") and both["model"].startswith("fla."), order
        assert both["ours"] == want, order


def test_compiled_decode_step_through_the_transformers_cache_equals_eager():
    """torch.compile(fullgraph=True) of one decode step reading and updating transformers'
    cache in place (aot_eager: no C++ build) against the same steps eager: logits and
    states."""
    m = ours("gqa_tied_clamp_sigmoid")
    x = ids(2, 6, seed=23)
    step = torch.compile(lambda tok, cache: m(tok, cache=cache).logits, fullgraph=True,
                         backend="aot_eager")
    eager, compiled = DynamicCache(config=m.config), DynamicCache(config=m.config)
    with torch.no_grad():
        tok = m(x, cache=eager).logits[:, -1:].argmax(-1)
        m(x, cache=compiled)
        buffers = [layer.recurrent_states[0] for layer in compiled.layers]
        for _ in range(4):
            want = m(tok, cache=eager).logits
            got = step(tok, compiled)
            assert rel_err(got, want) < 1e-6
            tok = want[:, -1:].argmax(-1)
    for a, b, buf in zip(eager.layers, compiled.layers, buffers):
        assert b.recurrent_states[0] is buf  # updated in place: a static address
        assert rel_err(b.recurrent_states[0], a.recurrent_states[0]) < 1e-6


def test_torch_side_imports_without_transformers():
    """The ops and layers need no transformers; the model's names say what is missing."""
    code = ("import sys; sys.modules['transformers'] = None\n"
            "import torch_side\nassert callable(torch_side.recurrent)\n"
            "try:\n    torch_side.GLAForCausalLM\nexcept ImportError as e:\n"
            "    print('ERR', e)\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "ERR torch_side.GLAForCausalLM: the GLA language model needs transformers" in \
        run.stdout
