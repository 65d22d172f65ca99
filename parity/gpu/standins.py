"""What the GPU kit's dry run (and the CPU tests) put where a GPU, CUDA or fla would be.

Each stand-in is named in the kit's output as a stand-in, never as a measurement:

- `posing_on_cuda(t)`: a CPU tensor (offsets, or any input) that reports device cuda:0
  and raises `HostRead` on every host read (`.cpu()`, `.item()`, `.numpy()`, `.tolist()`,
  `__array__`, `bool()`/`int()`, `.to()`): code that handles it without raising never
  synchronized with a GPU over it. Its arithmetic runs on the CPU underneath, so
  device-side checks (`torch._assert_async`) still fire on bad values.
- `JaxOnGpu`: offsets posing as a concrete JAX array on a GPU, whose values cannot be
  read at all.
- `FLA_STANDINS`: fla's `chunk_gla` / `fused_recurrent_gla` replaced by independent
  CPU code of the same signature (fla-core runs on CUDA only). Each also runs a tiny
  Triton kernel under `triton.autotune` (keyed on its output's size, timed by the host
  clock), so the kit's flow around fla's autotuner (tune once, write the winners, load
  them, refuse to tune in a timed process) runs in the dry run too.
- `failing`: an implementation that raises at every call (the dry run's proof that a
  failure stays on its own rows).
"""

import time

import numpy as np
import triton
import triton.language as tl

STANDIN_MODULE = __name__


def _host_bench(fn, quantiles=None, **_):
    t0 = time.perf_counter()
    fn()
    ms = (time.perf_counter() - t0) * 1e3
    return [ms, ms, ms]


@triton.autotune(configs=[triton.Config({"BLOCK": b}) for b in (64, 256)], key=["n"],
                 do_bench=_host_bench)
@triton.jit
def standin_tuned_copy(x, y, n, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + o, tl.load(x + o, mask=o < n), mask=o < n)


def _autotuned_touch(out):
    """Copy `out` through the autotuned stand-in kernel (the copy is dropped)."""
    import torch

    x = out.detach().reshape(-1).float().contiguous()
    y = torch.empty_like(x)
    standin_tuned_copy[lambda m: (triton.cdiv(x.numel(), m["BLOCK"]),)](x, y, x.numel())


class StandInFailure(RuntimeError):
    """The failure of the stand-in implementation that fails."""


def failing(*args, **kwargs):
    """An implementation that fails at every call (module doc)."""
    raise StandInFailure("stand-in implementation that always fails (the dry run's proof "
                         "that a failure stays on its own rows)")


class HostRead(AssertionError):
    """Offsets on a (posing) device were read on the host."""


_FORBIDDEN = ("cpu", "item", "numpy", "tolist", "__array__", "__bool__", "__int__",
              "__index__", "__float__", "to")


def _posing_class():
    import torch

    forbidden = {getattr(torch.Tensor, n) for n in _FORBIDDEN}

    class PosingOnCuda(torch.Tensor):
        """See `posing_on_cuda`."""

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func in forbidden:
                raise HostRead(f"cu_seqlens read on the host ({func.__name__})")
            prop = getattr(getattr(func, "__self__", None), "__name__", None)
            if prop == "device":
                return torch.device("cuda", 0)
            if prop == "is_cuda":
                return True
            return super().__torch_function__(func, types, args, kwargs or {})

    return PosingOnCuda


_CLASS = []


def posing_on_cuda(t):
    """`t` (a CPU tensor) posing as a CUDA tensor whose host reads raise (module doc)."""
    if not _CLASS:
        _CLASS.append(_posing_class())
    return t.as_subclass(_CLASS[0])


class _Device:
    platform = "gpu"

    def __str__(self):
        return "cuda:0"


class JaxOnGpu:
    """Offsets posing as a concrete JAX array on a GPU: shape, dtype and devices only;
    each attempt to read its values is listed in `reads` (and raises HostRead)."""

    def __init__(self, values):
        a = np.asarray(values)
        self.shape, self.dtype, self.reads = a.shape, a.dtype, []

    def devices(self):
        return {_Device()}

    def _read(self, how):
        self.reads.append(how)
        raise HostRead(f"cu_seqlens read on the host ({how})")

    def __array__(self, *a, **k):
        self._read("__array__")

    def tolist(self):
        self._read("tolist")


def chunk_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False,
              cu_seqlens=None, **_):
    """Stand-in for fla's chunk_gla: gla-bridge's torch-native chunked path (platform
    'torch'), an algorithm independent of the Triton kernels."""
    import torch_side

    out = torch_side.recurrent_gla(q, k, v, g, softmax_scale=scale, initial_state=initial_state,
                                   cu_seqlens=cu_seqlens, platform="torch")
    _autotuned_touch(out[0])
    return out


def fused_recurrent_gla(q, k, v, gk=None, scale=None, initial_state=None,
                        output_final_state=False, **_):
    """Stand-in for fla's fused_recurrent_gla: a plain per-step torch loop
    (parity.bench.decode.plain_torch), scaled as fla scales."""
    from parity.bench.decode import plain_torch

    K = q.shape[-1]
    if scale is not None:
        q = q * (scale * K ** 0.5)  # plain_torch applies K^-1/2 itself
    out = plain_torch(q, k, v, g=gk, initial_state=initial_state)
    _autotuned_touch(out[0])
    return out


FLA_STANDINS = {"chunk_gla": chunk_gla, "fused_recurrent_gla": fused_recurrent_gla}
