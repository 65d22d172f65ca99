"""AdamW's state in a checkpoint directory, readable by both frameworks.

Beside the model's config.json and model.safetensors (bridge.checkpoint), training
writes `optimizer.safetensors`:

    step                int64 []      steps taken (torch: state["step"]; optax: the Adam and
                                      schedule `count`s)
    exp_avg.<name>      float32       first moment of parameter <name> (fla's names;
                                      torch: state["exp_avg"]; optax: ScaleByAdamState.mu)
    exp_avg_sq.<name>   float32       second moment (torch: state["exp_avg_sq"]; optax: .nu)

and the hyper-parameters (parity.train.optim.Hyper) as JSON in the safetensors metadata
under "hyper". The safetensors library reads it (never pickle), so either framework
resumes what the other saved.
"""

import json
import os

import numpy as np

from .optim import Hyper

FILE = "optimizer.safetensors"
MOMENTS = ("exp_avg", "exp_avg_sq")


def save(directory, step: int, exp_avg: dict, exp_avg_sq: dict, hyper: Hyper) -> str:
    """Write optimizer.safetensors (the moments: {name: array}, the same names in both).
    Returns its path."""
    from safetensors.numpy import save_file

    if set(exp_avg) != set(exp_avg_sq):
        raise ValueError(f"exp_avg_sq: expected the names of exp_avg, differing in "
                         f"{sorted(set(exp_avg) ^ set(exp_avg_sq))}")
    arrays = {"step": np.asarray(step, np.int64)}
    for kind, moments in zip(MOMENTS, (exp_avg, exp_avg_sq)):
        arrays.update({f"{kind}.{n}": np.ascontiguousarray(a, np.float32)
                       for n, a in moments.items()})
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, FILE)
    save_file(arrays, path, metadata={"format": "pt", "optimizer": "adamw",
                                      "hyper": json.dumps(hyper.to_dict(), sort_keys=True)})
    return path


def load(directory, shapes: dict) -> tuple:
    """(step, exp_avg, exp_avg_sq, Hyper) from optimizer.safetensors, checked
    strictly against the model's parameter `shapes` ({name: shape}): ValueError listing
    every missing, unexpected or misshapen moment."""
    from safetensors import safe_open

    path = os.path.join(os.fspath(directory), FILE)
    if not os.path.isfile(path):
        raise ValueError(f"directory: no {FILE} in {directory} (a model checkpoint without "
                         f"optimizer state)")
    with safe_open(path, framework="np") as f:
        meta = f.metadata() or {}
        arrays = {k: f.get_tensor(k) for k in f.keys()}
    want = {"step": ()} | {f"{kind}.{n}": tuple(s) for kind in MOMENTS
                           for n, s in shapes.items()}
    missing, extra = sorted(set(want) - set(arrays)), sorted(set(arrays) - set(want))
    bad = [f"{k}: expected {want[k]}, got {arrays[k].shape}" for k in want
           if k in arrays and tuple(arrays[k].shape) != want[k]]
    if missing or extra or bad or "hyper" not in meta:
        raise ValueError(f"directory: {path} does not fit the model: missing {missing}, "
                         f"unexpected {extra}, wrong shapes {bad}"
                         + ("" if "hyper" in meta else ", no 'hyper' metadata"))
    moments = [{n: arrays[f"{kind}.{n}"] for n in shapes} for kind in MOMENTS]
    return int(arrays["step"]), moments[0], moments[1], Hyper(**json.loads(meta["hyper"]))

