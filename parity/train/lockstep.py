"""Two trainers stepped together on the same batches, compared after every step; the
probe that splits a step's gradient difference into its causes; the checkpoint round
trip between the two.

A row per step s (1-based): the learning rate, the loss each side computed at step s (on
the weights after s - 1 updates), the relative difference of the losses, the largest
relative difference of the gradients (before clipping) and of the weights after the
update, each the worst parameter's ||b - a|| / ||a|| (parity.compare.rel_err) with its
name, and the gradient norms. Side a is the reference of every relative difference.
"""

import os

import numpy as np

from bridge.model_config import init_rule, model_param_shapes
from parity.compare import rel_err
from .optim import schedule


def init_params(config, seed: int) -> dict:
    """{name: float32 array}: fla's init (bridge.model_config.init_rule) drawn once in
    NumPy from `seed`, the starting weights of both frameworks."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in model_param_shapes(config).items():
        rule = init_rule(name)
        if rule == "normal":
            out[name] = (rng.standard_normal(shape) * config.initializer_range).astype(np.float32)
        else:
            out[name] = (np.ones if rule == "ones" else np.zeros)(shape, np.float32)
    return out


def _worst(got: dict, want: dict) -> tuple:
    """(name, relative difference) of the parameter where got and want differ most."""
    errs = {n: rel_err(got[n], want[n]) for n in want}
    name = max(errs, key=errs.get)
    return name, errs[name]


def probe(a, b, ids) -> dict:
    """Before a step: each framework's gradients at each side's weights, which splits the
    step's gradient difference into the frameworks' arithmetic (the same weights in
    both: `frameworks`, from a's weights) and the weights' drift so far (one framework
    at both weights: `weights`, in a's framework). Each a (name, relative difference)."""
    wa, wb = a.params(), b.params()
    g_aa, g_ab, g_ba = a.gradients(wa, ids)[1], a.gradients(wb, ids)[1], b.gradients(wa, ids)[1]
    return dict(step=a.steps_done + 1, frameworks=_worst(g_ba, g_aa), weights=_worst(g_ab, g_aa))


def lockstep(a, b, batches, *, save_at=None, save_dir=None, probe_at=(), progress=None):
    """Step trainers a and b (parity.train.trainer_*) on each batch of `batches`
    ([S, B, T] ints) in turn: (one row per step (module docstring), probes). With
    save_at, both save a checkpoint after that step under save_dir/<framework>; before
    each step of probe_at, `probe`."""
    rows, probes = [], []
    for ids in batches:
        if a.steps_done + 1 in probe_at:
            probes.append(probe(a, b, ids))
        la, ga, na = a.step(ids)
        lb, gb, nb = b.step(ids)
        gname, grel = _worst(gb, ga)
        wname, wrel = _worst(b.params(), a.params())
        rows.append(dict(step=a.steps_done, lr=schedule(a.hyper, a.steps_done - 1),
                         loss=[la, lb], loss_rel=abs(lb - la) / abs(la),
                         grad_rel=grel, grad_worst=gname, weight_rel=wrel,
                         weight_worst=wname, grad_norm=[na, nb]))
        if progress:
            progress(rows[-1])
        if save_at == a.steps_done:
            for t in (a, b):
                t.save(os.path.join(save_dir, t.framework))
    return rows, probes


def continued(trainer, batches) -> list:
    """The losses of `trainer` on `batches` (a resumed run's rest)."""
    return [trainer.step(ids)[0] for ids in batches]


def round_trip(rows, resumed: dict, batches) -> dict:
    """How a run resumed in the other framework compares with the uninterrupted one.

    rows: lockstep's rows of the uninterrupted run (losses [a, b] per step);
    resumed: {"a->b": trainer b resumed from a's checkpoint, "b->a": ...} (each knows its
    step); batches: every step's batch. Per direction: the resumed losses and their
    relative differences from the uninterrupted run of the framework saved and of the
    framework loaded: the largest over every remaining step, over the first 20 of them,
    and at the last step."""
    out = {}
    for key, trainer in resumed.items():
        at = trainer.steps_done
        src, dst = (0, 1) if key == "a->b" else (1, 0)
        losses = continued(trainer, batches[at:])
        entry = dict(at=at, losses=losses)
        for name, col in (("vs_saved", src), ("vs_loaded", dst)):
            ref = [r["loss"][col] for r in rows[at:]]
            rel = [abs(x - y) / abs(y) for x, y in zip(losses, ref)]
            entry[name] = max(rel)
            entry[name + "_first20"] = max(rel[:20])
            entry[name + "_last"] = rel[-1]
        out[key] = entry
    return out
