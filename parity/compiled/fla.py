"""flash-linear-attention's GLA chunk kernels compiled like ours, with no GPU
(`python -m parity.compiled --report --compare-fla` runs this in a subprocess).

    TRITON_INTERPRET=0 python -m parity.compiled --fla --shape 8,4096,16,128,128 --dtype bf16 \
        [--json PATH]

Runs `fla.ops.gla.chunk_gla` forward (output_final_state=True) and its backward
(with a final-state gradient) on torch "meta" tensors of the shape, under a
stand-in Triton driver that reports an H100 (sm_90, 228 KiB shared memory, 132
SMs) and torch.cuda facts to match, so fla picks the autotune configs it offers
on an H100. No kernel runs: every launch is caught where its autotuner would
benchmark, and each config the autotuner would try (after fla's own pruning) is
compiled through Triton's own binder (`JITFunction.run(warmup=True)`: the
specialisation a real launch gets) for sm_90, then read by parity.compiled.sass with trip
counts from parity.compiled.tripcounts. Per launch the config with the fewest dynamic
warp-instructions is kept; the others are listed. fla's code is read from the
installed package (fla-core, the `bench` extra), never copied here.
"""

import contextlib
import inspect
import io
import sys
import time
import types

from . import timemodel

H100 = dict(max_shared_mem=232448, multiprocessor_count=132, max_num_regs=65536, warpSize=32,
            sm_clock_rate=1980000, mem_clock_rate=2619000, mem_bus_width=5120)


def _stand_in_h100(torch, triton):
    """A Triton driver and torch.cuda facts of an H100 that compile but never launch."""
    from triton.backends.compiler import GPUTarget

    class Utils:
        def get_device_properties(self, i=0):
            return dict(H100)

    class Driver:
        utils = Utils()

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, *a):
            return 0

        def get_device_interface(self):
            return torch.cuda

        def get_active_torch_device(self):
            return torch.device("meta")

        def is_active(self):
            return True

    triton.runtime.driver.set_active(Driver())
    props = types.SimpleNamespace(shared_memory_per_block_optin=H100["max_shared_mem"],
                                  shared_memory_per_block=49152, name="NVIDIA H100 80GB HBM3",
                                  multi_processor_count=H100["multiprocessor_count"], major=9,
                                  minor=0, total_memory=80 << 30)
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    torch.cuda.get_device_name = lambda *a, **k: props.name
    torch.cuda.get_device_properties = lambda *a, **k: props
    torch.cuda.device_count = lambda: 1
    torch.cuda.current_device = lambda: 0


def capture(shape, dtype="bf16") -> list:
    """[dict(phase, fn, args, kwargs, configs)] of every Triton launch chunk_gla's
    forward and backward make at `shape` (B, T, H, K, V), in order."""
    import torch
    import triton
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    if "fla.utils" in sys.modules:
        raise RuntimeError("fla was imported before the H100 stand-in: its autotune configs "
                           "would be the ones it offers on a CPU")
    _stand_in_h100(torch, triton)
    caught = []

    def autotuned(self, *args, **kwargs):
        self.nargs = dict(zip(self.arg_names, args))
        configs = self.prune_configs(kwargs)
        self.nargs = None
        caught.append(dict(fn=self.fn, args=args, kwargs=kwargs, configs=list(configs)))

    def plain(self, *args, **kwargs):
        caught.append(dict(fn=self, args=args, kwargs=kwargs, configs=[None]))

    Autotuner.run = autotuned
    JITFunction.run_unpatched = JITFunction.run
    JITFunction.run = plain
    import fla.utils
    from fla.ops.gla import chunk_gla
    from fla.ops.utils.cache import CachedAutotuner

    if not (fla.utils.IS_NVIDIA_HOPPER and fla.utils.check_shared_mem("hopper")):
        raise RuntimeError("fla does not see the H100 stand-in")

    CachedAutotuner.run = autotuned
    B, T, H, K, V = shape
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]

    def tensor(*s):
        return torch.empty(*s, dtype=dt, device="meta", requires_grad=True)

    q, k, v, g = tensor(B, T, H, K), tensor(B, T, H, K), tensor(B, T, H, V), tensor(B, T, H, K)
    o, ht = chunk_gla(q, k, v, g, output_final_state=True)
    n_fwd = len(caught)
    torch.autograd.backward([o, ht], [torch.empty_like(o), torch.empty_like(ht)])
    JITFunction.run = JITFunction.run_unpatched
    for i, c in enumerate(caught):
        c["phase"] = "fwd" if i < n_fwd else "bwd"
    return caught


def _config_text(cfg) -> str:
    if cfg is None:
        return "-"
    kw = ",".join(f"{k}={v}" for k, v in sorted(cfg.kwargs.items()))
    return f"{kw}{',' if kw else ''}w{cfg.num_warps}s{cfg.num_stages}"


_TRIPS = {}


def compile_config(entry, cfg, arch=90) -> dict:
    """One launch at one config: the record parity.compiled reports for ours."""
    from triton import knobs

    from . import build
    from .symbolic import UNKNOWN, pointer

    fn = entry["fn"]
    kwargs = dict(entry["kwargs"])
    grid = kwargs.pop("grid")
    kwargs.pop("warmup", None)
    if cfg is not None:
        kwargs.update(cfg.all_kwargs())
    names = fn.arg_names
    bound = dict(zip(names, entry["args"]))
    bound.update({k: v for k, v in kwargs.items() if k in names})
    for p in fn.params:
        if p.name not in bound and p.default is not inspect.Parameter.empty:
            bound[p.name] = p.default
    grid = grid(bound) if callable(grid) else grid
    grid = [int(x) for x in grid] + [1] * (3 - len(grid))
    buf = io.StringIO()
    with knobs.nvidia.scope(), contextlib.redirect_stdout(buf):
        knobs.nvidia.dump_ptxas_log = True
        k = fn.run_unpatched(*entry["args"], grid=grid, warmup=True, **kwargs)
    use = build.parse_ptxas_log(buf.getvalue())
    if use["regs"] is None:
        use = build.ptxas_usage(k.asm["ptx"], arch)
    num_warps = k.metadata.num_warps
    # tensors as pointers of their dtype, as parity.compiled passes ours
    params = {n: (None if v is None else v if isinstance(v, (bool, int, float, str))
                  else pointer(str(v.dtype).removeprefix("torch.")) if hasattr(v, "data_ptr")
                  else UNKNOWN)
              for n, v in bound.items()}
    memo = (fn.__name__, tuple(grid), repr(sorted(params.items(), key=lambda kv: kv[0])))
    if memo not in _TRIPS:  # configs that differ in warps / stages only share trip counts
        _TRIPS[memo] = build.launch_trips(fn, grid, params)
    trips, why = _TRIPS[memo]
    programs = grid[0] * grid[1] * grid[2]
    rec = dict(kernel=fn.__name__, phase=entry["phase"], target=f"sm_{arch}", grid=grid,
               programs=programs, num_warps=num_warps, num_stages=k.metadata.num_stages,
               config=_config_text(cfg), n_regs=use["regs"], n_spills=use["spill_bytes"] or 0,
               shared=k.metadata.shared, **build.count_mma(k.asm["ptx"]),
               # HBM bytes: every tensor argument read or written once
               bytes=sum(v.numel() * v.element_size() for v in bound.values()
                         if hasattr(v, "data_ptr")))
    rec.update(build.sass_fields(k, trips, num_warps, arch, rec["n_regs"], rec["shared"], why,
                               programs))
    return rec


def report(shape, dtype="bf16", log=None) -> dict:
    """{"launches": the cheapest config's record per launch (by dynamic
    warp-instructions), each with "configs": every config tried, "dynamic"
    {fwd, bwd}, "versions"}."""
    import triton

    from . import report

    launches = []
    entries = capture(shape, dtype)
    import fla

    for entry in entries:
        t0 = time.time()
        tried = []
        for cfg in entry["configs"]:
            try:
                tried.append(compile_config(entry, cfg))
            except Exception as e:  # a config that does not build is reported, not fatal
                tried.append(dict(config=_config_text(cfg), error=f"{type(e).__name__}: {e}"[:300]))
        built = [r for r in tried if "error" not in r]
        if not built:
            launches.append(dict(kernel=entry["fn"].__name__, phase=entry["phase"],
                                 target="sm_90", error=tried[0]["error"], configs=tried))
            continue
        best = dict(min(built, key=lambda r: r["dynamic"]))
        best["configs"] = [dict(config=r["config"], dynamic=r.get("dynamic"),
                                n_regs=r.get("n_regs"), n_spills=r.get("n_spills"),
                                **{k: r[k] for k in timemodel.FIELDS if k in r},
                                ctas_per_sm=r.get("ctas_per_sm"),
                                max_loop_bars=report.max_loop_bars(r) if "loops" in r else None,
                                error=r.get("error"))
                           for r in tried]
        launches.append(best)
        if log:
            log(f"fla {best['phase']} {best['kernel']}: {len(built)}/{len(tried)} configs built, "
                f"cheapest {best['config']} dyn={best['dynamic'] / 1e9:.3f}G "
                f"regs={best['n_regs']} spills={best['n_spills']} ctas/SM={best['ctas_per_sm']} "
                f"({time.time() - t0:.1f} s)")
    dyn = {p: sum(r.get("dynamic", 0) for r in launches if r["phase"] == p) for p in ("fwd", "bwd")}
    return dict(launches=launches, dynamic=dyn, shape=list(shape), dtype=dtype,
                versions=dict(fla=getattr(fla, "__version__", None), triton=triton.__version__))
