"""The backends a parity run can compare, each behind the same small interface.

`Backend.run(case, arrays, dtype)` takes float32 NumPy inputs already rounded
to `dtype` (so every backend and the oracle see identical values), hands them
to its framework through DLPack, and returns NumPy results: `o`,
`final_state` and `d<name>` for every differentiable input, the gradients of
sum(o * do) + sum(final_state * dfinal_state).
"""

import importlib.util

import numpy as np

from bridge.contract import INPUTS as GRAD_NAMES

from . import cases
from .cases import ACTIVATIONS


def round_to(a: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values exactly representable in `dtype` (bf16 via torch or ml_dtypes)."""
    if dtype in ("float32", "float64"):
        return a
    if dtype == "float16":
        return a.astype(np.float16).astype(np.float32)
    try:
        import ml_dtypes

        return a.astype(ml_dtypes.bfloat16).astype(np.float32)
    except ImportError:
        import torch

        return torch.from_numpy(a).to(torch.bfloat16).float().numpy()


def prepared(case, dtype: str, seed: int = 0) -> dict:
    """The case's inputs with the activations rounded to `dtype`."""
    return {n: round_to(a, dtype) if n in ACTIVATIONS else a
            for n, a in cases.inputs(case, seed).items()}


def checked(name, o, state, grads, inputs) -> dict:
    """{o, final_state, d<input>} after checking the SPEC's dtypes and shapes:
    o in q's dtype, final_state float32, each gradient in its input's dtype
    and shape. Works on torch tensors and jax arrays alike."""
    from bridge.contract import dtype_name

    if dtype_name(o) != dtype_name(inputs["q"]) or dtype_name(state) != "float32":
        raise AssertionError(f"{name}: o is {dtype_name(o)} (q {dtype_name(inputs['q'])}), "
                             f"final_state {dtype_name(state)}")
    out = dict(o=o, final_state=state)
    for n, gr in grads.items():
        x = inputs[n]
        if dtype_name(gr) != dtype_name(x) or tuple(gr.shape) != tuple(x.shape):
            raise AssertionError(f"{name}: d{n} is {dtype_name(gr)} {tuple(gr.shape)}, "
                                 f"input {dtype_name(x)} {tuple(x.shape)}")
        out["d" + n] = gr
    return out


class Backend:
    name = "?"
    framework = "?"
    interpreted = False  # slow: tiny cases only

    def unavailable(self):
        """None when this machine can run it, else the reason it is skipped."""
        return None

    def run(self, case, arrays, dtype):
        raise NotImplementedError


class Oracle(Backend):
    name, framework = "oracle", "numpy"

    def run(self, case, arrays, dtype):
        from . import oracle

        a = {n: np.asarray(x, np.float64) if n != "cu_seqlens" else x for n, x in arrays.items()}
        kw = cases.call_kwargs(case, a)
        o, state = oracle.recurrent(**kw)
        grads = oracle.recurrent_grads(**kw, do=a["do"], dfinal_state=a["dfinal_state"])
        return dict(o=o, final_state=state, **{"d" + n: g for n, g in grads.items()})


def _mode_suffix(mode) -> str:
    """The backend name's mark of a Triton family other than the default's (fused
    recurrent): "-chunk", "-fused-chunk"."""
    return "" if mode in ("auto", "fused_recurrent") else "-" + mode.replace("_", "-")


class TorchBackend(Backend):
    framework = "torch"

    def __init__(self, platform, mode="auto"):
        self.platform, self.mode = platform, mode
        self.name = f"torch-{platform}" + _mode_suffix(mode)

    def unavailable(self):
        if importlib.util.find_spec("torch") is None:
            return "torch is not installed"
        if self.platform == "triton":
            if importlib.util.find_spec("triton") is None:
                return "triton is not installed"
            from bridge import kernels
            self.interpreted = kernels.INTERPRETED
        return None

    def device(self):
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def run(self, case, arrays, dtype, through=("o", "final_state"), transform=None):
        """`through` picks the outputs the loss reads (testing each backward path);
        `transform` may rewrite the call's tensors (e.g. into strided views)."""
        import torch

        import torch_side

        t = {}
        for n, a in arrays.items():
            x = torch.from_dlpack(np.ascontiguousarray(a)).to(self.device())
            if n in ACTIVATIONS:
                x = x.to(getattr(torch, dtype))
            t[n] = x.requires_grad_(n in GRAD_NAMES)
        before = {n: x.detach().clone() for n, x in t.items()}
        kw = cases.call_kwargs(case, t)
        o, state = torch_side.recurrent(**(transform(kw) if transform else kw),
                                        platform=self.platform, mode=self.mode)
        names = [n for n in GRAD_NAMES if n in t]
        loss = 0
        if "o" in through:
            loss = loss + (o.float() * t["do"].float()).sum()
        if "final_state" in through:
            loss = loss + (state * t["dfinal_state"]).sum()
        grads = torch.autograd.grad(loss, [t[n] for n in names])
        for n, x in before.items():
            if not torch.allclose(x, t[n].detach(), rtol=0, atol=0, equal_nan=True):
                raise AssertionError(f"{self.name} wrote into its input {n}")
        out = checked(self.name, o, state, dict(zip(names, grads)), t)
        return {k: v.detach().float().cpu().numpy() for k, v in out.items()}


class JaxBackend(Backend):
    framework = "jax"

    def __init__(self, platform, mode="auto"):
        self.platform, self.mode = platform, mode
        self.name = f"jax-{platform}" + _mode_suffix(mode)

    def unavailable(self):
        if importlib.util.find_spec("jax") is None:
            return "jax is not installed"
        if self.platform == "triton":
            for dep in ("torch", "triton"):
                if importlib.util.find_spec(dep) is None:
                    return f"{dep} is not installed (the CPU launch runs the interpreter on torch)"
            from bridge import kernels
            self.interpreted = kernels.INTERPRETED
        return None

    def run(self, case, arrays, dtype):
        import jax
        import jax.numpy as jnp

        import jax_side

        x = {}
        for n, a in arrays.items():
            # from_dlpack of host memory commits to the CPU: move to the default device
            x[n] = jax.device_put(jnp.from_dlpack(np.ascontiguousarray(a)), jax.devices()[0])
            if n in ACTIVATIONS:
                x[n] = x[n].astype(dtype)
        kw = cases.call_kwargs(case, x)
        static = {n: kw.pop(n) for n in ("reverse", "softmax_scale")}
        diff = {n: kw.pop(n) for n in GRAD_NAMES if n in kw}

        def loss(diff, rest, do, dstate):
            o, state = jax_side.recurrent(**diff, **rest, **static, platform=self.platform,
                                          mode=self.mode)
            return ((o.astype(jnp.float32) * do.astype(jnp.float32)).sum()
                    + (state * dstate).sum()), (o, state)

        (_, (o, state)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(
            diff, kw, x["do"], x["dfinal_state"])
        out = checked(self.name, o, state, grads, x)
        return {k: np.asarray(v.astype(jnp.float32)) for k, v in out.items()}


def all_backends():
    """Every backend of the project, available or not (the oracle first)."""
    return [
        Oracle(),
        TorchBackend("triton", "fused_recurrent"),
        TorchBackend("torch"),
        JaxBackend("xla"),
        JaxBackend("triton", "fused_recurrent"),
        TorchBackend("triton", "chunk"),
        JaxBackend("triton", "chunk"),
        JaxBackend("pallas"),
        TorchBackend("triton", "fused_chunk"),
        JaxBackend("triton", "fused_chunk"),
    ]
