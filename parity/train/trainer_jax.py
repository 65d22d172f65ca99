"""The JAX half of the training comparison: jax_side's GLAForCausalLM (Flax NNX) and
optax.adamw (parity.train.optim), one jax.jit-compiled step at a time.

The trained pytree is {fla name: array}, so optax's moments carry the same names as
torch's state and the checkpoint. dtype "fp32": float32 throughout; "bf16": float32
parameters and optimizer, the model's computation dtype bfloat16 (NNX's dtype /
param_dtype; the model keeps norms, gates and recurrent states in float32).
`platform`: jax_side.ops' ("xla": the chunked jax.numpy path, "triton": the bridge
kernels, interpreted on CPU through a host callback).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jax_side.models import GLAForCausalLM
from . import optim, state

DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}


@functools.lru_cache(maxsize=None)
def _program(config, dtype, platform, hyper):
    """(tx, jitted step, params -> model) for one model and optimizer; cached, so runs
    with the same settings share one compilation."""
    abstract = nnx.eval_shape(lambda: GLAForCausalLM(
        config, rngs=nnx.Rngs(0), dtype=DTYPES[dtype], param_dtype=jnp.float32,
        platform=platform))
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
    if jax.tree.leaves(rest):
        raise RuntimeError(f"the JAX model holds state besides its parameters: {rest}")
    flat = nnx.to_flat_state(params)
    paths = {".".join(map(str, p)): p for p, _ in flat}
    tx = optim.optax_optimizer({".".join(map(str, p)): v.shape for p, v in flat}, hyper)

    def merge(p):
        return nnx.merge(graphdef, nnx.from_flat_state([(paths[n], a) for n, a in p.items()]))

    def step(p, opt_state, ids):
        loss, grads = jax.value_and_grad(lambda p: merge(p).loss(ids))(p)
        updates, opt_state = tx.update(grads, opt_state, p)
        return loss, grads, optax.apply_updates(p, updates), opt_state, optax.tree.norm(grads)

    return tx, jax.jit(step), merge


class JaxTrainer:
    """step(ids [B, T] int) -> (loss, {name: gradient before clipping}, gradient norm);
    gradients(params, ids) -> (loss, gradients) at other weights; params() -> {name:
    float32 array}; save(directory); JaxTrainer.resume(directory)."""

    framework = "jax"

    def __init__(self, config, params: dict, hyper: optim.Hyper, *, dtype="fp32",
                 platform="xla", moments=None):
        if dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {sorted(DTYPES)}, got {dtype!r}")
        self.config, self.hyper, self.dtype, self.platform = config, hyper, dtype, platform
        self.tx, self._step, self._merge = _program(config, dtype, platform, hyper)
        self.p = {n: jnp.asarray(a, jnp.float32) for n, a in params.items()}
        self.opt_state = self.tx.init(self.p)
        self.steps_done = 0
        if moments is not None:
            step, exp_avg, exp_avg_sq = moments
            as_jax = lambda m: {n: jnp.asarray(m[n], jnp.float32) for n in self.p}  # noqa: E731
            # optax.adamw's Adam moments and both counts (Adam's and the schedule's)
            self.opt_state = optax.tree_utils.tree_set(
                self.opt_state, mu=as_jax(exp_avg), nu=as_jax(exp_avg_sq),
                count=jnp.asarray(step, jnp.int32))
            self.steps_done = step

    @classmethod
    def start(cls, config, params: dict, hyper, *, dtype="fp32", platform="xla"):
        """A fresh run from `params` ({name: NumPy array})."""
        return cls(config, params, hyper, dtype=dtype, platform=platform)

    @classmethod
    def resume(cls, directory, *, dtype="fp32", platform="xla"):
        """Continue from a checkpoint either framework saved (`save`)."""
        model = GLAForCausalLM.from_pretrained(directory, param_dtype=jnp.float32,
                                               platform=platform)
        params = model.params()
        step, exp_avg, exp_avg_sq, hyper = state.load(
            directory, {n: a.shape for n, a in params.items()})
        return cls(model.config, params, hyper, dtype=dtype, platform=platform,
                   moments=(step, exp_avg, exp_avg_sq))

    def step(self, ids):
        loss, grads, self.p, self.opt_state, norm = self._step(
            self.p, self.opt_state, jnp.asarray(ids, jnp.int32))
        self.steps_done += 1
        return float(loss), {n: np.asarray(g) for n, g in grads.items()}, float(norm)

    def gradients(self, params: dict, ids):
        """(loss, {name: gradient}) at other weights `params`, taking no step."""
        # the compiled step at those weights, its update dropped: no second compilation
        loss, grads, *_ = self._step({n: jnp.asarray(params[n], jnp.float32) for n in self.p},
                                     self.opt_state, jnp.asarray(ids, jnp.int32))
        return float(loss), {n: np.asarray(g) for n, g in grads.items()}

    def params(self) -> dict:
        return {n: np.asarray(a) for n, a in self.p.items()}

    def save(self, directory) -> None:
        """The model (save_pretrained) and optimizer.safetensors (parity.train.state)."""
        self._merge(self.p).save_pretrained(directory)
        mu, nu = (optax.tree_utils.tree_get(self.opt_state, k) for k in ("mu", "nu"))
        state.save(directory, self.steps_done, {n: np.asarray(a) for n, a in mu.items()},
                   {n: np.asarray(a) for n, a in nu.items()}, self.hyper)
