"""The PyTorch half of the training comparison: torch_side's GLAForCausalLM and
torch.optim.AdamW (parity.train.optim), one step at a time.

dtype "fp32": float32 throughout; "bf16": float32 parameters and optimizer, the forward
and backward under torch.autocast("cpu", bfloat16) (matmuls in bf16; the model keeps
norms, gates and recurrent states in float32). `platform`: torch_side.ops' ("torch":
the native chunked path, "triton": the bridge kernels, interpreted on CPU).
"""

import contextlib

import numpy as np
import torch

from torch_side.models import GLAForCausalLM
from . import optim, state


class TorchTrainer:
    """step(ids [B, T] int) -> (loss, {name: gradient before clipping}, gradient norm);
    gradients(params, ids) -> (loss, gradients) at other weights; params() -> {name:
    float32 array}; save(directory); TorchTrainer.resume(directory)."""

    framework = "torch"

    def __init__(self, model: GLAForCausalLM, hyper: optim.Hyper, *, dtype="fp32",
                 moments=None):
        if dtype not in ("fp32", "bf16"):
            raise ValueError(f"dtype: expected 'fp32' or 'bf16', got {dtype!r}")
        self.model, self.hyper, self.dtype = model, hyper, dtype
        self.named = dict(model.named_parameters())
        self.opt = optim.torch_optimizer(self.named, hyper)
        self.steps_done = 0
        if moments is not None:
            self._set_moments(*moments)

    @classmethod
    def start(cls, config, params: dict, hyper, *, dtype="fp32", platform="torch"):
        """A fresh run from `params` ({name: NumPy array})."""
        model = GLAForCausalLM(config, platform=platform)
        model.load_params(params)
        return cls(model, hyper, dtype=dtype)

    @classmethod
    def resume(cls, directory, *, dtype="fp32", platform="torch"):
        """Continue from a checkpoint either framework saved (`save`)."""
        model = GLAForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                               platform=platform)
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        step, exp_avg, exp_avg_sq, hyper = state.load(directory, shapes)
        return cls(model, hyper, dtype=dtype, moments=(step, exp_avg, exp_avg_sq))

    def _set_moments(self, step, exp_avg, exp_avg_sq):
        for n, p in self.named.items():
            self.opt.state[p] = {"step": torch.tensor(float(step)),
                                 "exp_avg": torch.tensor(exp_avg[n]),
                                 "exp_avg_sq": torch.tensor(exp_avg_sq[n])}
        self.steps_done = step

    def _backward(self, ids):
        """(loss, {name: gradient}) of the model as it is, on ids."""
        ids = torch.from_numpy(np.asarray(ids, np.int64))
        self.opt.zero_grad(set_to_none=True)
        autocast = torch.autocast("cpu", torch.bfloat16) if self.dtype == "bf16" else \
            contextlib.nullcontext()
        with autocast:
            loss = self.model.loss(ids)
        loss.backward()
        return loss.item(), {n: p.grad.numpy().copy() for n, p in self.named.items()}

    def step(self, ids):
        loss, grads = self._backward(ids)
        norm = optim.torch_step(self.opt, list(self.named.values()), self.hyper,
                                self.steps_done)
        self.steps_done += 1
        return loss, grads, norm

    def gradients(self, params: dict, ids):
        """(loss, {name: gradient}) at other weights `params`, taking no step."""
        mine = self.params()
        self.model.load_params({n: torch.tensor(a) for n, a in params.items()})
        try:
            return self._backward(ids)
        finally:
            self.model.load_params(mine)
            self.opt.zero_grad(set_to_none=True)

    def params(self) -> dict:
        return {n: p.detach().numpy().copy() for n, p in self.named.items()}

    def save(self, directory) -> None:
        """The model (save_pretrained) and optimizer.safetensors (parity.train.state)."""
        self.model.save_pretrained(directory)
        moments = [{n: self.opt.state[p][k].numpy() if p in self.opt.state else
                    np.zeros(p.shape, np.float32) for n, p in self.named.items()}
                   for k in state.MOMENTS]
        state.save(directory, self.steps_done, *moments, self.hyper)
