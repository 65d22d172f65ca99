"""The GPU section: Triton chunked / fused recurrent kernels launched from torch and
from JAX against flash-linear-attention's chunk_gla / fused_recurrent_gla, bf16.

Without a CUDA device the section says so and measures nothing. On a GPU it
measures the device's ceilings in the same run (a big bf16 matmul, a big copy)
and reports time, TFLOP/s (flops.flops) and GB/s against them.
"""

import time

from . import flops as flopsmod

BIG_SHAPE = (8, 4096, 16, 128, 128)  # B, T, H, K, V
SWEEP_T = (512, 1024, 2048, 4096, 8192)


def unavailable():
    """None on a machine with a CUDA device, else why the section measures nothing."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device on this machine (torch.cuda.is_available() is False)"
    return None


def bytes_moved(B, T, H, K, V, mode, itemsize=2) -> int:
    """Minimum HBM traffic: every input and output tensor once. fwd reads q,k,g
    [..,K] and v, writes o [..,V]; the backward reads q,k,g,v,do and writes
    dq,dk,dg,dv."""
    per_token = (3 * K + 2 * V) if mode == "fwd" else (9 * K + 5 * V)
    return B * T * H * per_token * itemsize


def _cuda_time(fn, repeats=10):
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def _versions() -> str:
    import datetime
    import importlib.metadata
    import platform

    import torch

    names = ("torch", "triton", "jax", "jaxlib", "jax-triton", "fla-core")
    found = []
    for n in names:
        try:
            found.append(f"{n} {importlib.metadata.version(n)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{n} absent")
    return (f"{datetime.date.today().isoformat()}; Python {platform.python_version()}, "
            f"CUDA {torch.version.cuda}; " + ", ".join(found))


def _ceilings():
    import torch

    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    tf = 2 * n ** 3 / _cuda_time(lambda: a @ a) / 1e12
    src = torch.empty(2 ** 30 // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    gb = 2 * 2 ** 30 / _cuda_time(lambda: dst.copy_(src)) / 1e9
    return tf, gb


def _impls():
    """name -> op(q,k,v,g) returning o, for torch tensors (JAX ones convert via DLPack)."""
    import torch_side

    out = {
        "triton chunk (torch)": lambda q, k, v, g: torch_side.recurrent_gla(
            q, k, v, g, platform="triton", mode="chunk")[0],
        "triton fused_recurrent (torch)": lambda q, k, v, g: torch_side.recurrent_gla(
            q, k, v, g, platform="triton", mode="fused_recurrent")[0],
    }
    try:
        from fla.ops.gla import chunk_gla, fused_recurrent_gla

        out["fla chunk_gla"] = lambda q, k, v, g: chunk_gla(q, k, v, g)[0]
        out["fla fused_recurrent_gla"] = lambda q, k, v, g: fused_recurrent_gla(q, k, v, g)[0]
    except Exception as e:  # reported below as a missing anchor
        out["fla"] = e
    return out


def _torch_fns(op, a):
    import torch

    def fwd():
        with torch.no_grad():
            return op(*a[:4])

    def fwdbwd():
        leaves = [x.detach().requires_grad_(True) for x in a[:4]]
        return torch.autograd.grad(op(*leaves), leaves, grad_outputs=a[4])
    return fwd, fwdbwd


def _jax_fns(mode_name, a):
    import jax
    import jax.numpy as jnp

    import jax_side

    ins = [jax.dlpack.from_dlpack(x.detach()) for x in a]
    op = lambda q, k, v, g: jax_side.recurrent_gla(  # noqa: E731
        q, k, v, g, platform="triton", mode=mode_name)[0]
    f = jax.jit(op)
    df = jax.jit(jax.grad(lambda q, k, v, g, do: jnp.sum(op(q, k, v, g).astype(jnp.float32) * do),
                          argnums=(0, 1, 2, 3)))
    return (lambda: jax.block_until_ready(f(*ins[:4])),
            lambda: jax.block_until_ready(df(*ins)))


def launch_times(mode, size, tf_peak, gb_peak, repeats=10, device="cuda"):
    """Per launch of one Triton family at `size` (bf16, key gate g, both cotangents):
    rows (stage, kernel, grid, ms, lower-bound ms) where the bound is
    max(dot FLOPs / tf_peak, HBM bytes / gb_peak) from the launch's own cost model.
    The launches run one at a time over one env, as the torch launcher runs them."""
    import torch

    from bridge import contract
    from bridge.kernels import family
    from bridge.torch_runner import run

    B, T, H, K, V = size
    gen = torch.Generator(device=device).manual_seed(0)
    mk = lambda *s: torch.randn(*s, device=device, generator=gen).bfloat16()  # noqa: E731
    q, k, v = mk(B, T, H, K), mk(B, T, H, K), mk(B, T, H, V)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, K, device=device, generator=gen)
                                       ).bfloat16()
    plan = contract.check(q, k, v, g=g)
    env = dict(q=q, k=k, v=v, g=g, gk=None, gv=None, g_gamma=None, initial_state=None,
               cu_seqlens=None)
    fam = family(mode)
    rows = []
    for stage, launches in (("fwd", fam.forward_launches(plan)),
                            ("bwd", fam.backward_launches(plan, use_dht=True))):
        if stage == "bwd":
            env.update(do=mk(B, T, H, V), dfinal_state=torch.randn_like(env["final_state"]))
        for launch in launches:
            def once():
                run([launch], env, autotune=False)
            t = _cuda_time(once, repeats) if device == "cuda" else (once() or 0.0)
            bound = max(launch.dot_flops / (tf_peak * 1e12), launch.bytes / (gb_peak * 1e9))
            name = getattr(launch.kernel, "__name__", None) or launch.kernel.fn.__name__
            rows.append((stage, name, launch.grid, t * 1e3, bound * 1e3))
    return rows


def section(quick=False, log=print, Ts=None) -> str:
    """Markdown for the GPU section (a one-line reason when there is no GPU);
    `Ts` replaces the sweep's sequence lengths."""
    why = unavailable()
    if why:
        return f"not measured: no GPU lent ({why})."
    import torch

    tf_peak, gb_peak = _ceilings()
    lines = [f"Device: {torch.cuda.get_device_name()}; {_versions()}.", "",
             f"Measured ceilings: bf16 matmul "
             f"{tf_peak:.0f} TFLOP/s (8192^2), copy {gb_peak:.0f} GB/s (1 GiB).", "",
             "| (B,T,H,K,V) | mode | implementation | ms | TFLOP/s (% peak) | GB/s (% copy) |",
             "|---|---|---|---|---|---|"]
    B, T0, H, K, V = BIG_SHAPE
    Ts = Ts or ((256,) if quick else sorted(set(SWEEP_T) | {T0}))
    sizes = [(B, T, H, K, V) for T in Ts]
    impls = _impls()
    for size in sizes:
        B, T, H, K, V = size
        gen = torch.Generator(device="cuda").manual_seed(0)
        mk = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
        a = [mk(B, T, H, K).bfloat16(), mk(B, T, H, K).bfloat16(), mk(B, T, H, V).bfloat16(),
             (-torch.rand(B, T, H, K, device="cuda", generator=gen) * 0.5).bfloat16(),
             mk(B, T, H, V).bfloat16()]
        runs = {}
        for name, op in impls.items():
            runs[name] = op if isinstance(op, Exception) else _torch_fns(op, a)
        for mode_name in ("chunk", "fused_recurrent"):
            try:
                runs[f"triton {mode_name} (jax)"] = _jax_fns(mode_name, a)
            except Exception as e:
                runs[f"triton {mode_name} (jax)"] = e
        for mi, mode in enumerate(("fwd", "fwdbwd")):
            fl = flopsmod.flops(B, T, H, K, V, mode)
            by = bytes_moved(B, T, H, K, V, mode)
            for name, fns in runs.items():
                if isinstance(fns, Exception):
                    lines.append(f"| {size} | {mode} | {name} | error: {type(fns).__name__}: "
                                 f"{str(fns).splitlines()[0][:120] if str(fns) else ''} | - | - |")
                    continue
                try:
                    t = _cuda_time(fns[mi], repeats=3 if quick else 10)
                except Exception as e:
                    msg = (str(e).splitlines() or [""])[0][:160].replace("|", "/")
                    lines.append(f"| {size} | {mode} | {name} | error: {type(e).__name__}: {msg} | - | - |")
                    log(lines[-1])
                    continue
                tf, gb = fl / t / 1e12, by / t / 1e9
                lines.append(f"| {size} | {mode} | {name} | {t * 1e3:.2f} | "
                             f"{tf:.1f} ({100 * tf / tf_peak:.0f}%) | {gb:.0f} ({100 * gb / gb_peak:.0f}%) |")
                log(lines[-1])
    B, T, H, K, V = BIG_SHAPE
    lines += ["", f"Per launch at {BIG_SHAPE} bf16 (`launch_times`; bound: max(dot FLOPs / "
                  "measured matmul rate, HBM bytes / measured copy rate)):", "",
              "| family | stage | kernel | grid | ms | bound ms |", "|---|---|---|---|---|---|"]
    for mode in ("chunk", "fused_recurrent"):
        try:
            rows = launch_times(mode, (B, 256 if quick else T, H, K, V), tf_peak, gb_peak,
                                repeats=3 if quick else 10)
        except Exception as e:
            lines.append(f"| {mode} | - | error: {type(e).__name__}: {str(e)[:120]} | - | - | - |")
            continue
        for stage, name, grid, ms, bound in rows:
            lines.append(f"| {mode} | {stage} | {name} | {grid} | {ms:.3f} | {bound:.3f} |")
            log(lines[-1])
    lines += ["", "Targets (GPU): triton chunk >= 1.0x fla chunk_gla on fwd+bwd; the JAX launch "
              "within 5% of the torch launch (compare the rows above)."]
    return "\n".join(lines)
