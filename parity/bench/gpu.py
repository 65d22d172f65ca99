"""How the GPU kit (`python -m parity.gpu`) times and sizes things on one device.

- `bench(fn)`: milliseconds per call, the median of `triton.testing.do_bench` on CUDA
  (CUDA events, L2 flushed before every call); on the CPU (the kit's dry run) the median
  of a few host-clock calls, a stand-in.
- `rotating(make, set_bytes, l2_bytes)`: input sets cycled call by call, enough of them
  that consecutive calls never share inputs in the L2 cache.
- `peak_bytes(fn)`: device memory a call adds at its peak (torch's allocator).
- `ceilings()`: the machine's bf16 matmul rate and copy bandwidth, measured the same way.
- `launch_times(...)`: per launch of one Triton family, time beside its lower bound.

`section()` is `python -m parity.bench --gpu`: the kit's GPU section as markdown.
"""

import importlib.metadata
import math
import platform
import statistics
import time

from . import flops as flopsmod

BIG_SHAPE = (8, 4096, 16, 128, 128)  # B, T, H, K, V
PACKAGES = ("torch", "triton", "jax", "jaxlib", "jax-triton", "fla-core",
            "flash-linear-attention", "numpy")


def unavailable():
    """None on a machine with a CUDA device, else why the section measures nothing."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device on this machine (torch.cuda.is_available() is False)"
    return None


def versions() -> dict:
    """{package: version or 'absent'} of everything the kit's figures depend on."""
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "absent"
    return out


def bytes_moved(B, T, H, K, V, mode, itemsize=2) -> int:
    """Minimum HBM traffic: every input and output tensor once. fwd reads q,k,g
    [..,K] and v, writes o [..,V]; the backward reads q,k,g,v,do and writes
    dq,dk,dg,dv."""
    per_token = (3 * K + 2 * V) if mode == "fwd" else (9 * K + 5 * V)
    return B * T * H * per_token * itemsize


def bench(fn, device="cuda", warmup_ms=25, rep_ms=100, host_calls=3) -> float:
    """Median milliseconds per call of fn(). CUDA: triton.testing.do_bench (the first
    call, which compiles, is not timed). CPU (the kit's dry run, interpreted kernels that
    compile nothing): the median of `host_calls` host-clock calls."""
    if device == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    times = []
    for _ in range(host_calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def rotating(make, set_bytes, l2_bytes, most=8):
    """A callable giving make(i) for i = 0, 1, 2, ... cycled over enough sets (at least 2,
    at most `most`) that their bytes exceed 3x the L2 cache. The sets are made up front."""
    n = max(2, min(most, math.ceil(3 * l2_bytes / max(set_bytes, 1))))
    sets = [make(i) for i in range(n)]
    state = [0]

    def next_set():
        state[0] = (state[0] + 1) % n
        return sets[state[0]]
    next_set.count = n
    return next_set


def peak_bytes(fn, device="cuda"):
    """Bytes of device memory one call of fn() adds at its peak, outputs included (torch's
    caching allocator: max_memory_allocated over the call, less what was allocated
    before); None off CUDA."""
    if device != "cuda":
        return None
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return int(peak)


def ceilings(device="cuda", matmul_n=8192, copy_bytes=2 ** 30, rep_ms=100):
    """(TFLOP/s of an n^3 matmul in bf16, GB/s of a device-to-device copy counting bytes
    read and written), both on random data, timed by `bench`. On the CPU (dry run) the
    matmul is float32."""
    import torch

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    tf = 2 * matmul_n ** 3 / (_matmul_ms(matmul_n, dtype, device, gen, rep_ms) * 1e-3) / 1e12
    src = torch.randn(copy_bytes // 2, device=device, generator=gen).to(torch.bfloat16)
    dst = torch.empty_like(src)
    gb = 2 * copy_bytes / (bench(lambda: dst.copy_(src), device, rep_ms=rep_ms) * 1e-3) / 1e9
    return tf, gb


def _matmul_ms(n, dtype, device, gen, rep_ms):
    """ms of one [n, n] @ [n, n] product in `dtype` (its operands freed on return)."""
    import torch

    a = torch.randn(n, n, device=device, generator=gen).to(dtype)
    b = torch.randn(n, n, device=device, generator=gen).to(dtype)
    return bench(lambda: a @ b, device, rep_ms=rep_ms)


def gla_inputs(size, device="cuda", dtype=None, seed=0):
    """(q, k, v, g, do) at size (B,T,H,K,V): normal activations, GLA's key gate
    logsigmoid(x) / 16 (its default gate normalizer), bf16 on CUDA, float32 on CPU."""
    import torch

    B, T, H, K, V = size
    dtype = dtype or (torch.bfloat16 if device == "cuda" else torch.float32)
    gen = torch.Generator(device=device).manual_seed(seed)
    mk = lambda *s: torch.randn(*s, device=device, generator=gen)  # noqa: E731
    g = torch.nn.functional.logsigmoid(mk(B, T, H, K)) / 16
    return (mk(B, T, H, K).to(dtype), mk(B, T, H, K).to(dtype), mk(B, T, H, V).to(dtype),
            g.to(dtype), mk(B, T, H, V).to(dtype))


def launch_times(mode, size, tf_peak, gb_peak, device="cuda", rep_ms=50):
    """Per launch of one Triton family at `size` (key gate g, both cotangents): rows
    {stage, kernel, grid, ms, bound_ms} where the bound is max(dot FLOPs / tf_peak, HBM
    bytes / gb_peak) from the launch's own cost model. The launches run one at a time
    over one env, as the torch launcher runs them (the backward reusing the forward's
    kept buffers)."""
    import torch

    from bridge import contract
    from bridge.kernels import family
    from bridge.torch_runner import run

    q, k, v, g, do = gla_inputs(size, device)
    plan = contract.check(q, k, v, g=g)
    env = dict(q=q, k=k, v=v, g=g, gk=None, gv=None, g_gamma=None, initial_state=None,
               cu_seqlens=None)
    fam = family(mode)
    rows = []
    for stage, launches in (("fwd", fam.forward_launches(plan)),
                            ("bwd", fam.backward_launches(plan, True, fam.kept(plan)))):
        if stage == "bwd":
            env.update(do=do, dfinal_state=torch.randn_like(env["final_state"]))
        for launch in launches:
            def once(launch=launch):
                run([launch], env, autotune=False)
            ms = bench(once, device, rep_ms=rep_ms, host_calls=1)
            bound = max(getattr(launch, "dot_flops", 0) / (tf_peak * 1e12),
                        getattr(launch, "bytes", 0) / (gb_peak * 1e9))
            kernel = launch.kernel
            name = getattr(kernel, "__name__", None) or getattr(kernel, "fn", kernel).__name__
            rows.append({"stage": stage, "kernel": name, "grid": list(launch.grid), "ms": ms,
                         "bound_ms": bound * 1e3})
    return rows


def rates(size, mode, ms):
    """(TFLOP/s by flops.flops, GB/s by bytes_moved) of one call of `ms` milliseconds."""
    B, T, H, K, V = size
    s = ms * 1e-3
    return (flopsmod.flops(B, T, H, K, V, mode) / s / 1e12,
            bytes_moved(B, T, H, K, V, mode) / s / 1e9)


def section(quick=False, log=print) -> str:
    """Markdown for the GPU section (`python -m parity.bench --gpu`): the kit run here
    without touching BENCHMARKS.md; a one-line reason when there is no GPU."""
    why = unavailable()
    if why:
        return f"not measured: no GPU on this machine ({why})."
    import tempfile

    from parity.gpu import __main__ as kit, render

    with tempfile.TemporaryDirectory() as out:
        result = kit.run_kit(out=out, quick=quick, md=None, results_json=None, log=log)
    return render.markdown(result)
