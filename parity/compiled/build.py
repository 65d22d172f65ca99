"""Ahead-of-time builds of the Triton kernels' launches, with no GPU: each launch
of a launch list compiled to PTX and cubin for a CUDA arch through Triton's own
compiler, specialised as a real launch is (`build_source`); what ptxas reports
(registers, spills, shared memory); the tensor-core instructions in the PTX; the
roofline lower bound of a launch; and the SASS columns (parity.compiled.sass, with
trip counts from parity.compiled.tripcounts)."""

import os
import re

from bridge import dispatch, tuning
from bridge.contract import ARGS, nbytes
from bridge.launch import resolve_dtype

SMEM_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}

_TL = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "int32": "i32", "int64": "i64"}
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}

# H100 SXM peaks (dense): the roofline of `lower_bound`.
PEAK_TC_FLOPS = 989e12     # bf16 / fp16 tensor cores
PEAK_TF32_FLOPS = 494.7e12  # tf32 tensor cores
PEAK_FP32_FLOPS = 67e12     # fp32 FMA units: dots without mma/wgmma (ieee fp32)
PEAK_HBM_BYTES = 3.35e12    # HBM3


def for_arch(arch: int):
    """A block within which the launch lists are the ones a device of `arch` runs (the
    rules on the instruction set, `tuning.wgmma`), its SM count unknown (no split)."""
    return tuning.on_device(f"{arch // 10}.{arch % 10} (built ahead for sm_{arch})")


def variants():
    """(label, plan, input dtypes) covering every flag value, dtype and block size."""
    from bridge.contract import Plan

    def plan(K=64, V=64, H=2, Hk=1, g="none", gk=False, gv=False, g_gamma="none", h0=False,
             reverse=False, varlen=False, dtype="float32"):
        return Plan(B=1, T=64, H=H, Hk=Hk, K=K, V=V, N=2 if varlen else 1, g=g, gk=gk, gv=gv,
                    g_gamma=g_gamma, initial_state=h0, scale=K ** -0.5, reverse=reverse,
                    varlen=varlen, packed=False, dtype=dtype)

    out = [("plain", plan()),
           ("g-head", plan(g="head")), ("g-key", plan(g="key")), ("gk", plan(gk=True)),
           ("gv", plan(gv=True)), ("gamma-head", plan(g_gamma="head")),
           ("gamma-seq+varlen", plan(g_gamma="seq", varlen=True)),
           ("h0+reverse", plan(h0=True, reverse=True)), ("gqa", plan(H=4, Hk=2))]
    everything = dict(g="key", gk=True, gv=True, g_gamma="seq", h0=True, reverse=True,
                      varlen=True, H=4, Hk=2)
    for dtype in ("float32", "float16", "bfloat16"):
        out.append((f"all-{dtype}", plan(dtype=dtype, **everything)))
    for K, V in ((16, 16), (32, 48), (100, 100), (128, 128), (256, 256), (256, 64)):
        out.append((f"K{K}-V{V}", plan(K=K, V=V, g="head", gv=True, h0=True)))
    # the widest heads (dispatch.HEAD_DIMS; families that refuse them are skipped)
    out += [("K512-V512-key-bf16", plan(K=512, V=512, g="key", dtype="bfloat16")),
            ("K512-V512-all-bf16", plan(K=512, V=512, dtype="bfloat16", **everything)),
            # K not a power of two (300: not a multiple of 64, the last K block masked)
            ("K320-V96-head-gv-bf16", plan(K=320, V=96, g="head", gv=True, h0=True,
                                           reverse=True, dtype="bfloat16")),
            ("K300-V96-key-gk-fp32", plan(K=300, V=96, g="key", gk=True, varlen=True))]
    return out


# ---------------------------------------------------------------- tensor dtypes

def input_dtypes(plan, gamma_like_q: bool = False) -> dict:
    """dtype of every tensor a caller hands in (`Plan.tensor_dtype`). The variant
    mode keeps its historical g_gamma in q's dtype (`gamma_like_q`)."""
    d = {n: plan.tensor_dtype(n) for n in (*ARGS, "do", "dfinal_state")}
    if gamma_like_q:
        d["g_gamma"] = plan.dtype
    return d


def tensor_dtypes(plan, launch_lists, gamma_like_q: bool = False) -> dict:
    """{name: dtype} for the inputs and for every Out of the launch lists, in
    order (forward then backward), so a buffer an earlier launch wrote (e.g. a
    forward state reused by the backward) has that Out's dtype."""
    env = input_dtypes(plan, gamma_like_q)
    for launches in launch_lists:
        for launch in launches:
            for o in launch.writes():
                env[o.name] = resolve_dtype(o.dtype, env.__getitem__)
    return env


def workspace_bytes(plan, launches) -> int:
    """Device memory a backward launch list allocates beyond the gradients it
    returns: the bytes of every Out buffer minus the bytes of the gradients of
    the inputs present in `plan` (`Plan.gradients`)."""
    total = sum(o.nbytes(plan) for launch in launches for o in launch.writes())
    return total - sum(nbytes(s, d) for s, d in plan.gradients().values())


# ---------------------------------------------------------------- compiling

def _tensor_name(kind, value) -> str:
    """The tensor a launch's tensor argument points at: an input's name, an Out's name,
    or for an absent one q (the launchers pass q's pointer there)."""
    if value is None:
        return "q"
    return value.name if kind == "out" else value


def build_source(launch, dtypes: dict, hints: bool = True, floats: str = "fp32"):
    """Triton's ASTSource for `launch`, specialised as a real launch is: pointers
    (absent ones get q, as the launchers pass it) 16-byte aligned and integer
    scalars divisible by 16 where they are (`tt.divisibility` 16), an int of 1
    a constant; floats never specialised, typed `floats` ("fp32" as Triton's own
    launcher types a Python float, "fp64" as Inductor types a user kernel's under
    torch.compile on CUDA). `hints=False` drops the alignment."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource

    fn = launch.kernel
    sig, constexprs, attrs = {}, dict(launch.constexprs), {}
    for p in fn.arg_names:
        if p in constexprs:
            sig[p] = "constexpr"
    for p, kind, a in launch.arguments():
        if kind != "scalar":
            # torch allocations are 256-byte aligned: every pointer gets "D"
            ty, spec = "*" + _TL[dtypes[_tensor_name(kind, a)]], "D"
        else:
            # the same call JITFunction's binder makes for a scalar argument
            ty, spec = native_specialize_impl(CUDABackend, a, False, True, True)
            ty = floats if ty == "fp32" else ty
        if ty == "constexpr":
            sig[p], constexprs[p] = "constexpr", spec
            continue
        sig[p] = ty
        if hints and spec:
            attrs[(fn.arg_names.index(p),)] = CUDABackend.parse_attr(spec)
    return ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)


def compile_source(launch, dtypes, arch, hints=True, floats="fp32"):
    import triton
    from triton.backends.compiler import GPUTarget

    return triton.compile(build_source(launch, dtypes, hints, floats),
                          target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": launch.num_warps,
                                   "num_stages": launch.num_stages})


class Float32Default(dict):
    """Variant mode's dtypes: a buffer no Out of the launch names is float32."""

    def __missing__(self, key):
        return "float32"


def compile_launch(launch, plan, arch, hints=True, dtypes=None):
    """Build one launch of `plan` for `arch`: shared memory, registers, spills.
    Without `dtypes`, as the variant mode always did: g_gamma in q's dtype and
    a buffer of an earlier launch float32 (pass `tensor_dtypes` to resolve it)."""
    if dtypes is None:
        dtypes = Float32Default(tensor_dtypes(plan, [[launch]], gamma_like_q=True))
    k = compile_source(launch, dtypes, arch, hints)
    return dict(shared=k.metadata.shared, **ptxas_usage(k.asm["ptx"], arch))


def ptxas_usage(ptx: str, arch: int) -> dict:
    """Registers and spill bytes, from Triton's bundled ptxas (-v), since the
    compiled kernel reports them only once loaded onto a GPU."""
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        arch_name = f"sm_{arch}a" if arch == 90 else f"sm_{arch}"
        res = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name={arch_name}", path,
                              "-o", os.path.join(d, "k.cubin")], capture_output=True, text=True)
    return parse_ptxas_log(res.stdout + res.stderr)


def parse_ptxas_log(log: str) -> dict:
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.findall(r"(\d+) bytes spill (?:stores|loads)", log)
    return dict(regs=int(regs.group(1)) if regs else None,
                spill_bytes=sum(int(x) for x in spills) if spills else None)


def compile_with_usage(launch, dtypes, arch, hints=True):
    """(compiled kernel, registers and spills) from the ptxas -v run Triton
    itself makes for the cubin (its flags, no second ptxas run); a kernel
    found in Triton's cache has no log, so ptxas runs again on its PTX."""
    import contextlib
    import io

    from triton import knobs

    buf = io.StringIO()
    with knobs.nvidia.scope(), contextlib.redirect_stdout(buf):
        knobs.nvidia.dump_ptxas_log = True
        k = compile_source(launch, dtypes, arch, hints)
    use = parse_ptxas_log(buf.getvalue())
    if use["regs"] is None:
        use = ptxas_usage(k.asm["ptx"], arch)
    return k, use


# ---------------------------------------------------------------- reading PTX

_MMA = re.compile(r"^\s*(?:@!?%\w+\s+)?mma\.sync\.aligned\.m\d+n\d+k\d+\.row\.col"
                  r"\.\w+\.(\w+)\.(\w+)\.\w+", re.M)
_WGMMA = re.compile(r"^\s*(?:@!?%\w+\s+)?wgmma\.mma_async\.sync\.aligned\.m\d+n\d+k\d+"
                    r"\.\w+\.(\w+)\.(\w+)", re.M)


def count_mma(ptx: str) -> dict:
    """Tensor-core instructions in PTX: mma.sync (sm_80 style) and
    wgmma.mma_async (sm_90) counts and their distinct A/B operand types."""
    mma, wgmma = _MMA.findall(ptx), _WGMMA.findall(ptx)
    types = sorted({t for pair in mma + wgmma for t in pair})
    return dict(mma=len(mma), wgmma=len(wgmma), mma_types=types)


def lower_bound(rec: dict) -> tuple:
    """(microseconds, peak FLOP/s used) of a launch record on an H100 SXM:
    max(dot_flops / peak, bytes / HBM peak). The peak is the tensor cores'
    when the PTX has mma/wgmma (tf32's when tf32 is the only operand type),
    else the fp32 FMA units'."""
    if rec.get("mma") or rec.get("wgmma"):
        types = set(rec.get("mma_types") or ())
        peak = PEAK_TF32_FLOPS if types == {"tf32"} else PEAK_TC_FLOPS
    else:
        peak = PEAK_FP32_FLOPS
    us = max(rec.get("dot_flops", 0) / peak, rec.get("bytes", 0) / PEAK_HBM_BYTES) * 1e6
    return us, peak


# ---------------------------------------------------------------- SASS

def launch_params(launch, dtypes: dict = None) -> dict:
    """{parameter: value} of a launch for `parity.compiled.tripcounts`: constexprs and
    scalars as given, tensors pointers of their dtype in `dtypes` ({name: dtype
    name}, as `tensor_dtypes` gives; absent ones get q's, as the launchers pass
    q), or UNKNOWN without `dtypes`."""
    from .symbolic import UNKNOWN, pointer

    params = dict(launch.constexprs)
    for p, kind, a in launch.arguments():
        if kind == "scalar":
            params[p] = a
        else:
            params[p] = pointer(dtypes[_tensor_name(kind, a)]) if dtypes else UNKNOWN
    return params


def launch_trips(kernel, grid, params):
    """(TripCounts, None) of one launch, or (None, the reason it failed)."""
    from .tripcounts import trip_counts

    try:
        return trip_counts(kernel, grid, params), None
    except Exception as e:  # the report says so and counts each loop once per program
        return None, f"trip counts not derived: {type(e).__name__}: {e}"[:300]


def sass_fields(compiled, trips, num_warps, arch, regs, shared, trips_error=None,
                programs=1) -> dict:
    """The SASS columns of one compiled launch: CTAs per SM (and what limits
    them), static instructions, loops, dynamic warp-instruction estimate."""
    from . import sass

    occ = sass.occupancy(regs, shared, num_warps, arch)
    a = sass.analyze(compiled.asm["cubin"], compiled.asm.get("ptx", ""), trips, num_warps,
                     programs=programs)
    notes = list(a.notes) + ([trips_error] if trips_error else [])
    return dict(ctas_per_sm=occ["ctas"], occupancy=occ, sass_instructions=a.instructions,
                loops=a.loops, dynamic=a.dynamic, dynamic_classes=a.dynamic_classes,
                sass_notes=notes, mma_flops=a.mma_flops, chain=a.chain)


def stages(families, plan):
    """(stage, launches, dtypes) of each family's forward and backward lists for
    `plan` as autograd runs them (the backward with the buffers the forward keeps), the
    forward without a backward where it differs ("fwd-infer": fused_chunk keeps A) and
    fused_chunk's split forward ("fwd-split"); a buffer the forward writes keeps its
    dtype in the backward."""
    for fam in families:
        if dispatch.refusal(plan, fam.__name__.rsplit(".", 1)[1]) is not None:
            continue
        fwd, infer = fam.forward_launches(plan), fam.forward_launches(plan, keep=False)
        with tuning.overriding({("fused_chunk", "split"): dict(segments=2)}):
            split = fam.forward_launches(plan)  # fused_chunk's split forward
        kept = fam.kept(plan)
        lists = [("fwd", fwd), *([("fwd-infer", infer)] if infer != fwd else []),
                 *([("fwd-split", split)] if split != fwd else []),
                 ("bwd", fam.backward_launches(plan, True, kept)),
                 ("bwd-nodht", fam.backward_launches(plan, False, kept))]
        dtypes = Float32Default(tensor_dtypes(plan, [ls for _, ls in lists], gamma_like_q=True))
        for stage, launches in lists:
            yield stage, launches, dtypes
