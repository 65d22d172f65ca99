"""One AdamW, written for both frameworks: torch.optim.AdamW and optax.adamw made equal.

Per step s (0-based, t = s + 1), on the gradients g of every parameter p:

    g     <- g * min(1, clip / (||g||_global + 1e-6))       gradient clipping
    m     <- b1 m + (1 - b1) g ;  v <- b2 v + (1 - b2) g^2
    p     <- p - lr(s) * ( (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)  +  wd(p) p )

with lr(s) a linear warmup then a cosine (`schedule`), wd(p) = weight_decay for the
matrices of the projections and the lm head and 0 for norms, biases and the embedding
(`decays`). The two libraries already agree on everything but the clipping:
torch's AdamW decays p by (1 - lr wd) before its Adam step, optax.adamw adds wd p to the
Adam direction before scaling by -lr (the same update, since the Adam direction does
not depend on p); both put eps outside the square root and correct both moments. The
clipping differs: torch.nn.utils.clip_grad_norm_ divides by ||g|| + 1e-6,
optax.clip_by_global_norm by ||g||, so the JAX side clips with torch's rule
(`clip_by_global_norm`, an optax transform).
"""

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class Hyper:
    """AdamW's hyper-parameters and the learning-rate schedule (`steps`: the cosine's
    length; the learning rate starts at lr * lr_start and ends at lr * lr_end)."""

    lr: float = 1e-3
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip: float = 1.0
    warmup: int = 10
    steps: int = 200
    lr_start: float = 0.1
    lr_end: float = 0.1

    def __post_init__(self):
        if not (isinstance(self.warmup, int) and isinstance(self.steps, int)
                and 0 < self.warmup < self.steps):
            raise ValueError(f"warmup: expected ints 0 < warmup < steps, got warmup="
                             f"{self.warmup!r}, steps={self.steps!r}")
        for name in ("lr", "eps", "clip"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: expected a number > 0, got {getattr(self, name)!r}")
        if not (0 <= self.b1 < 1 and 0 <= self.b2 < 1 and self.weight_decay >= 0):
            raise ValueError(f"b1, b2: expected values in [0, 1) and weight_decay >= 0, got "
                             f"{self.b1!r}, {self.b2!r}, {self.weight_decay!r}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def schedule(h: Hyper, step: int) -> float:
    """The learning rate of step `step` (0-based), in float64: linear from lr * lr_start
    to lr over `warmup` steps, then a cosine down to lr * lr_end at `steps` (flat after;
    optax.warmup_cosine_decay_schedule's formula)."""
    if step < h.warmup:
        return h.lr * (h.lr_start + (1.0 - h.lr_start) * step / h.warmup)
    frac = min(step - h.warmup, h.steps - h.warmup) / (h.steps - h.warmup)
    return h.lr * (h.lr_end + (1.0 - h.lr_end) * 0.5 * (1.0 + math.cos(math.pi * frac)))


def decays(name: str, shape) -> bool:
    """Whether weight decay applies: matrices except the token embedding (norm weights,
    biases and the embedding are left alone)."""
    return len(shape) == 2 and not name.endswith("embeddings.weight")


# ------------------------------------------------------------------------- torch
def torch_optimizer(named, h: Hyper):
    """torch.optim.AdamW over `named` ({name: Parameter}) with two groups (decayed or
    not); the learning rate is set per step by `torch_step`."""
    import torch

    groups = [dict(params=[p for n, p in named.items() if decays(n, p.shape) == d],
                   weight_decay=h.weight_decay if d else 0.0) for d in (True, False)]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=h.lr, betas=(h.b1, h.b2),
                             eps=h.eps, foreach=False)


def torch_step(opt, params, h: Hyper, step: int) -> float:
    """Clip the gradients of `params` (torch.nn.utils.clip_grad_norm_), set the learning
    rate of step `step` and take one AdamW step. Returns the gradients' global norm
    before clipping."""
    import torch

    norm = torch.nn.utils.clip_grad_norm_(params, h.clip, foreach=False)
    for group in opt.param_groups:
        group["lr"] = schedule(h, step)
    opt.step()
    return float(norm)


# ------------------------------------------------------------------------- optax
def clip_by_global_norm(max_norm: float):
    """optax transform: g * min(1, max_norm / (||g|| + 1e-6)), torch's clip_grad_norm_
    rule (optax.clip_by_global_norm divides by ||g|| alone)."""
    import jax
    import jax.numpy as jnp
    import optax

    def update(updates, state, params=None):
        del params
        scale = jnp.minimum(1.0, max_norm / (optax.tree.norm(updates) + 1e-6))
        return jax.tree.map(lambda g: g * scale.astype(g.dtype), updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def optax_optimizer(shapes: dict, h: Hyper):
    """clip_by_global_norm then optax.adamw, for a parameter dict with `shapes`
    ({name: shape}); the schedule is optax.warmup_cosine_decay_schedule."""
    import optax

    lr = optax.warmup_cosine_decay_schedule(
        init_value=h.lr * h.lr_start, peak_value=h.lr, warmup_steps=h.warmup,
        decay_steps=h.steps, end_value=h.lr * h.lr_end)
    mask = {n: decays(n, s) for n, s in shapes.items()}
    return optax.chain(clip_by_global_norm(h.clip),
                       optax.adamw(lr, b1=h.b1, b2=h.b2, eps=h.eps,
                                   weight_decay=h.weight_decay, mask=mask))
