"""Training parity (parity/train): AdamW in torch and optax against a float64 update
written out here, a short training run of a tiny GLA model in both frameworks in
lockstep, and the checkpoint round trip between them (model and optimizer state)."""

import math

import numpy as np
import pytest

pytest.importorskip("optax", reason="optax (the 'models' extra) trains the JAX side")
pytest.importorskip("flax", reason="flax (the 'models' extra) builds the JAX model")

from bridge.model_config import GLAConfig  # noqa: E402
from parity.train import data, lockstep, optim, report, state  # noqa: E402

# lr(s) / lr for warmup=2, steps=5, lr_start=lr_end=0.1, by hand: 0.1, 0.1 + 0.9/2, then
# 0.1 + 0.9 (1 + cos(pi k/3)) / 2 for k = 0, 1, 2
LR_TABLE = [0.1, 0.55, 1.0, 0.775, 0.325]
TOY = {"model.embeddings.weight": (6, 4), "model.layers.0.attn.q_proj.weight": (3, 4),
       "model.layers.0.attn.gk_proj.1.bias": (3,), "model.norm.weight": (4,)}
DECAYED = {"model.layers.0.attn.q_proj.weight"}
# gradients clipped to a small norm, eps as large as their entries and a strong decay:
# every term of the update shows, torch's 1e-6 in the clipping included
HYPER = optim.Hyper(lr=0.1, b1=0.8, b2=0.9, eps=1e-4, weight_decay=0.5, clip=1e-3, warmup=2,
                    steps=5)


def _reference(params, grads, h):
    """AdamW with torch's clipping in float64: the parameters after each step."""
    p = {n: a.astype(np.float64) for n, a in params.items()}
    m = {n: np.zeros_like(a) for n, a in p.items()}
    v = {n: np.zeros_like(a) for n, a in p.items()}
    out = []
    for s, g in enumerate(grads):
        t = s + 1
        norm = math.sqrt(sum(float(np.sum(x.astype(np.float64) ** 2)) for x in g.values()))
        c = min(1.0, h.clip / (norm + 1e-6))
        lr = h.lr * LR_TABLE[s]
        for n in p:
            gn = g[n].astype(np.float64) * c
            m[n] = h.b1 * m[n] + (1 - h.b1) * gn
            v[n] = h.b2 * v[n] + (1 - h.b2) * gn * gn
            adam = (m[n] / (1 - h.b1 ** t)) / (np.sqrt(v[n] / (1 - h.b2 ** t)) + h.eps)
            wd = h.weight_decay if n in DECAYED else 0.0
            p[n] = p[n] - lr * (adam + wd * p[n])
        out.append({n: a.copy() for n, a in p.items()})
    return out


def _toy():
    rng = np.random.default_rng(3)
    # small weights: their fp32 rounding stays far below a step (lr 0.1 x O(1))
    params = {n: (rng.standard_normal(s) * 0.01).astype(np.float32) for n, s in TOY.items()}
    # global norms ~6.6 x scale: clipped on three steps, not on two
    grads = [{n: (rng.standard_normal(s) * scale).astype(np.float32) for n, s in TOY.items()}
             for scale in (1.0, 1e-4, 1e-2, 5e-5, 1.0)]
    return params, grads


def test_schedule_and_decay_mask():
    import optax

    for s, frac in enumerate(LR_TABLE):
        assert optim.schedule(HYPER, s) == pytest.approx(HYPER.lr * frac, rel=1e-12)
    sched = optax.warmup_cosine_decay_schedule(0.1 * HYPER.lr, HYPER.lr, HYPER.warmup,
                                               HYPER.steps, 0.1 * HYPER.lr)
    assert [float(sched(s)) for s in range(5)] == pytest.approx(
        [HYPER.lr * f for f in LR_TABLE], rel=1e-6)
    assert {n for n, s in TOY.items() if optim.decays(n, s)} == DECAYED
    assert optim.decays("lm_head.weight", (256, 32))
    with pytest.raises(ValueError, match="warmup"):
        optim.Hyper(warmup=5, steps=5)


def test_adamw_torch_and_optax_equal_float64_update():
    import jax
    import jax.numpy as jnp
    import optax
    import torch

    params, grads = _toy()
    want = _reference(params, grads, HYPER)
    named = {n: torch.nn.Parameter(torch.tensor(a)) for n, a in params.items()}
    opt = optim.torch_optimizer(named, HYPER)
    tx = optim.optax_optimizer(TOY, HYPER)
    jp = {n: jnp.asarray(a) for n, a in params.items()}
    js, update = tx.init(jp), jax.jit(tx.update)  # one compilation, not one per op
    for s, g in enumerate(grads):
        for n, p in named.items():
            p.grad = torch.tensor(g[n])
        norm = optim.torch_step(opt, list(named.values()), HYPER, s)
        assert norm == pytest.approx(math.sqrt(sum(np.sum(x.astype(np.float64) ** 2)
                                                   for x in g.values())), rel=1e-6)
        updates, js = update({n: jnp.asarray(a) for n, a in g.items()}, js, jp)
        jp = optax.apply_updates(jp, updates)
        for n in TOY:
            moved = np.linalg.norm(want[s][n] - (want[s - 1][n] if s else params[n]))
            # relative to the step's own size: a wrong eps, decay or lr is O(1) of it
            for side, got in (("torch", named[n].detach().numpy()), ("optax", jp[n])):
                err = np.linalg.norm(np.asarray(got, np.float64) - want[s][n]) / moved
                assert err < 2e-5, (side, s, n, err)


TINY = GLAConfig(hidden_size=32, num_hidden_layers=1, num_heads=2, vocab_size=data.VOCAB,
                 intermediate_size=64, initializer_range=0.05)
STEPS, AT, B, T = 8, 4, 2, 32


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The uninterrupted lockstep run (torch native vs XLA, fp32) with both sides saved
    after step AT and probed before step AT + 1."""
    from parity.train.trainer_jax import JaxTrainer
    from parity.train.trainer_torch import TorchTrainer

    hyper = optim.Hyper(lr=3e-3, warmup=2, steps=STEPS)
    batches = data.batches(data.corpus(), STEPS, B, T, seed=0)
    params = lockstep.init_params(TINY, seed=0)
    a = TorchTrainer.start(TINY, params, hyper)
    b = JaxTrainer.start(TINY, params, hyper)
    tmp = tmp_path_factory.mktemp("train")
    rows, probes = lockstep.lockstep(a, b, batches, save_at=AT, save_dir=str(tmp),
                                     probe_at={AT + 1})
    return rows, probes, batches, tmp


def test_lockstep_losses_gradients_weights(run):
    rows, probes, _, _ = run
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert rows[-1]["loss"][0] < rows[0]["loss"][0] - 0.05  # it learns
    for r in rows:
        assert r["loss_rel"] <= 1e-5, r
        assert r["grad_rel"] <= 1e-4 and r["weight_rel"] <= 1e-4, r
    # the probe: both frameworks' gradients at torch's weights; it leaves both runs as they
    # were (test_checkpoint_round_trip replays steps after it exactly)
    (probe,) = probes
    assert probe["step"] == AT + 1 and probe["frameworks"][1] <= 1e-5, probe


def test_checkpoint_round_trip(run):
    from parity.train.trainer_jax import JaxTrainer
    from parity.train.trainer_torch import TorchTrainer

    rows, _, batches, tmp = run
    resumed = {"a->b": JaxTrainer.resume(tmp / "torch"),
               "b->a": TorchTrainer.resume(tmp / "jax")}
    assert {k: t.steps_done for k, t in resumed.items()} == {"a->b": AT, "b->a": AT}
    trip = lockstep.round_trip(rows, resumed, batches)
    for key, r in trip.items():
        assert len(r["losses"]) == STEPS - AT
        assert r["vs_saved"] <= 1e-5 and r["vs_loaded"] <= 1e-5, (key, r)
    # within one framework the checkpoint holds the whole state: the same losses exactly
    for cls, col in ((JaxTrainer, 1), (TorchTrainer, 0)):
        again = lockstep.continued(cls.resume(tmp / cls.framework), batches[AT:])
        assert again == [r["loss"][col] for r in rows[AT:]], cls.framework


def test_optimizer_state_file_is_checked(tmp_path):
    shapes = {"a.weight": (2, 3)}
    m = {"a.weight": np.ones((2, 3), np.float32)}
    state.save(tmp_path, 7, m, m, HYPER)
    step, exp_avg, _, hyper = state.load(tmp_path, shapes)
    assert step == 7 and hyper == HYPER and np.array_equal(exp_avg["a.weight"], m["a.weight"])
    with pytest.raises(ValueError, match=r"missing \['exp_avg.b.bias'"):
        state.load(tmp_path, shapes | {"b.bias": (3,)})
    with pytest.raises(ValueError, match="wrong shapes"):
        state.load(tmp_path, {"a.weight": (3, 2)})
    with pytest.raises(ValueError, match="no optimizer.safetensors"):
        state.load(tmp_path / "nowhere", shapes)


def test_batches_and_section():
    text = data.corpus()
    x = data.batches(text, 3, 2, 16, seed=5)
    assert x.shape == (3, 2, 16) and x.dtype == np.int32
    assert np.array_equal(x, data.batches(text, 3, 2, 16, seed=5))
    start = bytes(text).find(bytes(x[1, 0].astype(np.uint8)))  # each row a window of the text
    assert start >= 0
    with pytest.raises(ValueError, match="seq"):
        data.batches(text[:10], 1, 1, 16, seed=0)
    md = "# B\n\n## A\n\nold\n\n## Training parity\n\nstale\n\n## C\n\nkept\n"
    new = report.splice(md, "## Training parity\n\nfresh\n")
    assert new == "# B\n\n## A\n\nold\n\n## Training parity\n\nfresh\n\n## C\n\nkept\n"
    assert report.splice("# B\n", "## Training parity\n\nx\n") == \
        "# B\n\n## Training parity\n\nx\n"
