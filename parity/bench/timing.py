"""How time, memory and the machine's ceilings are measured (CPU).

Time: one call of each compared implementation after another (alternating, so
slow drifts of this VM hit all of them alike), `repeats` rounds after warm-up
calls, median per implementation.

Peak memory: the growth of the process's resident set during one call, the
same method for torch and JAX: return freed heap memory to the OS
(malloc_trim; with MALLOC_ARENA_MAX=1 there is one heap), reset the kernel's
high-water mark (writing 5 to /proc/self/clear_refs resets VmHWM), then
peak = VmHWM after the call - VmRSS before it. It counts every byte the call
touches that was not already resident: temporaries and outputs, for torch and
XLA alike. Where the reset is not allowed the column says so.

Tensor peak (tests): the most bytes of torch tensors alive at once during a
call beyond those alive before it, from the profiler's allocation events; the
same on every run whatever glibc's arenas and the machine's load do.
"""

import ctypes
import gc
import statistics
import time

MALLOC_ENV = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_MAX_": "0",
              "MALLOC_TRIM_THRESHOLD_": "100000000000"}


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise OSError(f"{key} not in /proc/self/status")


def _reset_peak() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_memory_bytes(fn, tries: int = 1) -> int:
    """Peak resident-set growth (bytes) during one call of fn(): the least of `tries`
    calls (heap reuse and glibc's arenas only ever add to a call's growth)."""
    peaks = []
    for _ in range(tries):
        _reset_peak()
        before = _status_kib("VmRSS")
        out = fn()
        peaks.append(max(_status_kib("VmHWM") - before, 0) * 1024)
        del out
    return min(peaks)


def peak_tensor_bytes(fn) -> int:
    """Most bytes of torch tensors allocated during one call of fn() and alive at once
    (its outputs included), from torch.profiler's allocation and free events in order."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    del out
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    alive = peak = 0
    for e in events:
        alive += e.nbytes()  # negative for a free
        peak = max(peak, alive)
    return peak


def timed(fn) -> float:
    t0 = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    del out
    return dt


def median(xs) -> float:
    return float(statistics.median(xs))


def matmul_gflops(n: int = 2048, repeats: int = 5) -> float:
    """This machine's fp32 matmul rate (GFLOP/s), torch n x n @ n x n, median."""
    import torch

    a = torch.randn(n, n)
    b = torch.randn(n, n)
    a @ b  # warm-up
    return 2 * n ** 3 / median(timed(lambda: a @ b) for _ in range(repeats)) / 1e9


def copy_gbps(n_bytes: int = 256 * 2 ** 20, repeats: int = 5) -> float:
    """Memory bandwidth (GB/s, read + write) of a big torch copy."""
    import torch

    src = torch.empty(n_bytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return 2 * n_bytes / median(timed(lambda: dst.copy_(src)) for _ in range(repeats)) / 1e9


# The chunk the chunked forwards use on CPU (torch_side/native.py, jax_side/xla.py's slab
# scan): one batched matmul [Z, C, K] x [Z, K, V] over every chunk of every row and head
# is the shape their matmuls have, so its rate bounds what a chunked path can reach.
CHUNK = 32


def chunk_matmul_gflops(shape, T: int, repeats: int = 5) -> dict:
    """Rate (GFLOP/s) of one batched fp32 matmul [Z, C, K] x [Z, K, V], Z = B*H*T/C
    chunks of C = CHUNK tokens for shape (B, H, K, V): torch.bmm and XLA's jitted dot
    (median after a warm-up), {"torch": x, "xla": y}."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    B, H, K, V = shape
    Z = B * H * max(1, T // CHUNK)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((Z, CHUNK, K), dtype=np.float32)
    b = rng.standard_normal((Z, K, V), dtype=np.float32)
    flops = 2 * Z * CHUNK * K * V
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    dot = jax.jit(lambda x, y: jnp.einsum("zck,zkv->zcv", x, y))
    ja, jb = jnp.asarray(a), jnp.asarray(b)
    runs = {"torch": lambda: torch.bmm(ta, tb),
            "xla": lambda: dot(ja, jb).block_until_ready()}
    out = {}
    for name, fn in runs.items():
        fn()
        fn()  # warm-up: compile, first touch of the output's pages
        out[name] = flops / median(timed(fn) for _ in range(repeats)) / 1e9
    return out
