"""`python -m bridge.aot --report`: what the compiled kernels are, without a GPU.

The report runs in a subprocess with TRITON_INTERPRET=0 (this process may run
Triton's interpreter) and each run is shared by several tests (module-scoped
fixtures): every compile costs 1-3 s. Grid sizes come from the launch lists
directly, no compile needed.

test_chunk_uses_tensor_cores and test_chunk_grids_fill_the_gpu are the target
for the chunk rewrite (bf16/fp16 tensor-core products, enough programs): they
fail on the fp32 "ieee" chunk kernels with one program per (value block,
sequence x head), by design.
"""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

import bridge.kernels  # noqa: E402,F401  (decides the interpreter before triton is imported)
from bridge import aot  # noqa: E402
from bridge.kernels import chunk, fused_recurrent  # noqa: E402

SMALL = (2, 256, 4, 128, 128)   # K = V = 128: the largest head size held to no spills
SMALL64 = (2, 256, 4, 64, 64)
REFERENCE = (8, 4096, 16, 128, 128)
FIELDS = ("kernel", "phase", "target", "grid", "programs", "num_warps", "num_stages", "n_regs",
          "n_spills", "shared", "mma", "wgmma", "mma_types", "dot_flops", "bytes",
          "lower_bound_us", "peak_flops", "ctas_per_sm", "occupancy", "sass_instructions", "loops",
          "dynamic", "dynamic_classes", "sass_notes")
MMA_TYPE = {"bf16": "bf16", "fp16": "f16"}
SMEM = {"sm_80": 163 * 1024, "sm_90": 227 * 1024}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _start(tmp, *args):
    """Start `python -m bridge.aot --report *args --json` in a subprocess."""
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp / "cache"))
    return subprocess.Popen([sys.executable, "-m", "bridge.aot", "--report", *args, "--json"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT)


def _finish(proc):
    """The parsed JSON of a report run. Exit status 1 (a launch failed to build:
    its record has "error") still gives the report, so each test names what it
    needs."""
    try:
        out, err = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode in (0, 1) and out.startswith("{"), out[-4000:] + err[-4000:]
    rep = json.loads(out)
    failed = any("error" in r or r["shared"] > SMEM[r["target"]] for r in rep["launches"])
    assert proc.returncode == int(failed), err[-4000:]
    return rep


def _shape_arg(shape):
    return ",".join(map(str, shape))


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """The chunk family's reports on sm_80 and sm_90, run side by side:
    "bf16": (report, ptx dir) at K = V = 128; "fp16": report at K = V = 64."""
    t16, t32 = tmp_path_factory.mktemp("aot_bf16"), tmp_path_factory.mktemp("aot_fp16")
    procs = [_start(t16, "--shape", _shape_arg(SMALL), "--dtype", "bf16", "--mode", "chunk",
                    "--arch", "80", "--arch", "90", "--ptx-dir", str(t16 / "ptx")),
             _start(t32, "--shape", _shape_arg(SMALL64), "--dtype", "fp16", "--arch", "80,90")]
    try:
        bf16, fp16 = (_finish(p) for p in procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return {"bf16": (bf16, t16 / "ptx"), "fp16": (fp16, None)}


@pytest.fixture
def bf16_report(reports):
    return reports["bf16"]


@pytest.fixture(params=["bf16", "fp16"])
def chunk_report(request, reports):
    return request.param, reports[request.param][0]


def _check_structure(rep, plan, launches_of):
    """Fields, phases, bounds and workspace of one report."""
    assert rep["versions"]["triton"] and rep["dtype"] in ("bf16", "fp16", "fp32")
    recs = rep["launches"]
    for r in recs:
        missing = [f for f in FIELDS if f not in r]
        assert not missing and "error" not in r, (r["kernel"], missing, r.get("error"))
        assert r["programs"] == _product(r["grid"]) and all(isinstance(x, int) for x in r["grid"])
        assert isinstance(r["n_regs"], int) and isinstance(r["shared"], int)
        if r["dot_flops"] > 0 or r["bytes"] > 0:
            assert r["lower_bound_us"] > 0, r
        assert r["lower_bound_us"] == pytest.approx(aot.lower_bound(r)[0])
    assert {r["phase"] for r in recs} == {"fwd", "bwd"}
    assert {r["target"] for r in recs} == {"sm_80", "sm_90"}
    b = rep["lower_bound_us"]
    for phase in ("fwd", "bwd"):
        assert b[phase] == pytest.approx(sum(r["lower_bound_us"] for r in recs
                                             if r["phase"] == phase and r["target"] == "sm_90"))
    assert b["total"] == pytest.approx(b["fwd"] + b["bwd"])
    for target, dyn in rep["dynamic_warp_instructions"].items():
        for phase in ("fwd", "bwd"):
            assert dyn[phase] == pytest.approx(sum(r["dynamic"] for r in recs if r["phase"] == phase
                                                   and r["target"] == target)) and dyn[phase] > 0
    for r in recs:
        assert 1 <= r["ctas_per_sm"] <= 32 and r["sass_instructions"] > 0
        # code outside loops runs at least once per program and warp
        assert r["dynamic"] >= r["programs"] * r["num_warps"]
        for lp in r["loops"]:
            assert lp["runs"] >= 0 and lp["static_nested"] >= lp["static"] > 0
    # the backward as the default plan runs it: reusing what the family keeps
    kept = launches_of.kept(plan)
    assert rep["kept"] == list(kept)
    backward = launches_of.backward_launches(plan, True, kept)
    assert [r["kernel"] for r in recs if r["phase"] == "bwd" and r["target"] == "sm_90"] == [
        launch.kernel.__name__ for launch in backward]
    ws = rep["workspace_bytes"]
    assert isinstance(ws, int) and ws >= 0
    assert ws == aot.workspace_bytes(plan, backward)


def _product(xs):
    n = 1
    for x in xs:
        n *= x
    return n


def test_report_structure(bf16_report):
    """Every launch has every field; both phases; bounds and workspace consistent."""
    rep, _ = bf16_report
    _check_structure(rep, aot.report_plan(SMALL, "bf16"), chunk)
    assert rep["shape"] == dict(B=2, T=256, H=4, Hk=4, K=128, V=128, N=2)
    names = [r["kernel"] for r in rep["launches"] if r["target"] == "sm_90"]
    plan = aot.report_plan(SMALL, "bf16")
    assert names == [l.kernel.__name__ for l in chunk.forward_launches(plan)
                     + chunk.backward_launches(plan, True, kept=chunk.kept(plan))]
    assert "chunk_intra_kernel" not in names[len(chunk.forward_launches(plan)):]  # A reused


def test_ptx_dir_matches_counts(bf16_report):
    """--ptx-dir writes one file per launch and arch; the JSON's mma/wgmma
    counts equal a plain line count over those files."""
    rep, ptx_dir = bf16_report
    built = [r for r in rep["launches"] if "error" not in r]  # test_report_structure: none
    assert sorted(r["ptx_file"] for r in built) == sorted(os.listdir(ptx_dir))
    for r in built:
        assert re.fullmatch(rf"{r['kernel']}\.{r['phase']}(\.\d+)?\.{r['target']}\.bf16\.ptx",
                            r["ptx_file"])
        lines = [ln.split()[0] for ln in (ptx_dir / r["ptx_file"]).read_text().splitlines()
                 if ln.strip() and not ln.strip().startswith("//")]
        assert r["mma"] == sum(op.startswith("mma.sync") for op in lines)
        assert r["wgmma"] == sum(op.startswith("wgmma.mma_async") for op in lines)


def _kernel_doc(name):
    fn = getattr(chunk, name, None) or getattr(fused_recurrent, name, None)
    return (getattr(fn, "__doc__", None) or getattr(getattr(fn, "fn", None), "__doc__", None)
            or "")


def test_chunk_uses_tensor_cores(chunk_report):
    """The chunk family's products run on tensor cores in bf16/fp16: every launch
    with dot_flops > 0 has mma.sync on sm_80 and mma.sync or wgmma on sm_90, of
    the input's type (tf32 only in a kernel whose docstring mentions tf32).
    Fails on fp32 "ieee" products, and where the family leaves dot_flops at 0."""
    dtype, rep = chunk_report
    recs = rep["launches"]
    for phase in ("fwd", "bwd"):
        assert any(r["dot_flops"] > 0 for r in recs if r["phase"] == phase), \
            f"no {phase} launch of the chunk family states its dot_flops"
    bad = []
    for r in recs:
        if r["dot_flops"] <= 0:
            continue
        allowed = {MMA_TYPE[dtype]} | ({"tf32"} if "tf32" in _kernel_doc(r["kernel"]) else set())
        tensor_cores = r["mma"] > 0 if r["target"] == "sm_80" else r["mma"] + r["wgmma"] > 0
        if not tensor_cores or not r["mma_types"] or not set(r["mma_types"]) <= allowed:
            bad.append((r["kernel"], r["phase"], r["target"], r["mma"], r["wgmma"],
                        r["mma_types"], r.get("error")))
    assert not bad, bad


def test_chunk_no_spills_and_fits_shared_memory(chunk_report):
    """No register spills at K = V <= 128; shared memory within 163 KiB (sm_80)
    and 227 KiB (sm_90)."""
    _, rep = chunk_report
    bad = [(r["kernel"], r["phase"], r["target"], r["n_spills"], r["shared"], r.get("error"))
           for r in rep["launches"]
           if r["n_spills"] != 0 or r["shared"] is None or r["shared"] > SMEM[r["target"]]]
    assert not bad, bad


def test_chunk_grids_fill_the_gpu():
    """At (B,T,H,K,V) = (8,4096,16,128,128) bf16 the forward's output kernel
    (name with "output" or "_o_"/"_o") and every backward launch but the
    sequential state-gradient pass (name with "state") have >= 8192 programs."""
    plan = aot.report_plan(REFERENCE, "bf16")
    fwd = chunk.forward_launches(plan)
    out = [l for l in fwd if re.search(r"output|_o(_|$)", l.kernel.__name__)]
    assert out, f"no forward output kernel among {[l.kernel.__name__ for l in fwd]}"
    small = [(l.kernel.__name__, l.grid) for l in out if _product(l.grid) < 8192]
    small += [(l.kernel.__name__, l.grid) for l in chunk.backward_launches(plan, True)
              if "state" not in l.kernel.__name__ and _product(l.grid) < 8192]
    assert not small, small


def test_fused_recurrent_report(tmp_path):
    """The fused family reports too (no tl.dot: no tensor-core instructions)."""
    rep = _finish(_start(tmp_path, "--mode", "fused_recurrent", "--shape", _shape_arg(SMALL64),
                         "--dtype", "bf16"))
    _check_structure(rep, aot.report_plan(SMALL64, "bf16"), fused_recurrent)
    assert rep["mode"] == "fused_recurrent"
    for r in rep["launches"]:
        if r["dot_flops"] == 0:
            assert r["mma"] == r["wgmma"] == 0, r


def test_lower_bound_arithmetic():
    """max(flops / peak, bytes / 3.35e12), the peak picked from the PTX."""
    rec = dict(dot_flops=int(989e9), bytes=int(3.35e9), mma=0, wgmma=8, mma_types=["bf16"])
    assert aot.lower_bound(rec) == (pytest.approx(1000.0), 989e12)
    rec.update(bytes=int(3.35e6))  # compute-bound now
    assert aot.lower_bound(rec)[0] == pytest.approx(1000.0)
    rec.update(dot_flops=int(2 * 989e9))
    assert aot.lower_bound(rec)[0] == pytest.approx(2000.0)
    # no mma/wgmma: fp32 FMA units (ieee fp32 products)
    fma = dict(dot_flops=int(67e9), bytes=0, mma=0, wgmma=0, mma_types=[])
    assert aot.lower_bound(fma) == (pytest.approx(1000.0), 67e12)
    tf32 = dict(dot_flops=int(494.7e9), bytes=0, mma=4, wgmma=0, mma_types=["tf32"])
    assert aot.lower_bound(tf32) == (pytest.approx(1000.0), 494.7e12)
    assert aot.lower_bound(dict(dot_flops=0, bytes=0, mma=0, wgmma=0, mma_types=[]))[0] == 0


def test_workspace_bytes_by_hand():
    """Outs of the backward list minus the returned gradients, by hand."""
    from bridge.launch import Launch, Out

    plan = aot.report_plan((1, 32, 2, 16, 8), "bf16", gates="head")
    def three(x, y, z):
        pass

    def one(x):
        pass

    three.arg_names, one.arg_names = ("x", "y", "z"), ("x",)
    launches = [Launch(three, (1,), {}, {}, dict(x=Out("a", (1, 32, 2, 16)),      # fp32
                                               y=Out("dq", (1, 32, 2, 16), "like:q"), z=None)),
                Launch(one, (1,), {}, {}, dict(x=Out("b", (4,), "float32")))]
    outs = 32 * 2 * 16 * 4 + 32 * 2 * 16 * 2 + 16
    grads = (32 * 2 * 16 * 2) * 2 + 32 * 2 * 8 * 2 + 32 * 2 * 2  # q, k, v, g [B,T,H]
    assert aot.workspace_bytes(plan, launches) == outs - grads


_TOY = '''
import json, sys
import triton, triton.language as tl
from bridge import aot
from bridge.launch import Launch, Out

@triton.jit
def toy(a, b, c, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr, IEEE: tl.constexpr):
    m, n, k = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
    x = tl.load(a + m[:, None] * K + k[None, :])
    y = tl.load(b + k[:, None] * N + n[None, :])
    if IEEE:
        z = tl.dot(x.to(tl.float32), y.to(tl.float32), input_precision="ieee")
    else:
        z = tl.dot(x, y)
    tl.store(c + m[:, None] * N + n[None, :], z)

out = {}
for dtype in ("bfloat16", "float16"):
    for ieee in (False, True):
        launch = Launch(toy, (1,), dict(a="q", b="k"), {}, dict(c=Out("c", (64, 64))),
                        dict(M=64, N=64, K=64, IEEE=ieee), num_warps=4)
        for arch in (80, 90):
            k = aot._compile(launch, dict(q=dtype, k=dtype, c="float32"), arch)
            out[f"{dtype}-{ieee}-{arch}"] = aot.count_mma(k.asm["ptx"])
print(json.dumps(out))
'''


def test_count_mma_on_a_compiled_dot(tmp_path):
    """count_mma on real PTX: a 64x64x64 bf16/fp16 tl.dot is mma.sync on sm_80
    and wgmma on sm_90 (4 warps, M = 64), of the operands' type; an fp32 "ieee"
    product has no tensor-core instruction."""
    (tmp_path / "toy_dot.py").write_text(textwrap.dedent(_TOY))
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, str(tmp_path / "toy_dot.py")], env=env,
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-4000:]
    got = json.loads(res.stdout.splitlines()[-1])
    for dtype, t in (("bfloat16", "bf16"), ("float16", "f16")):
        assert got[f"{dtype}-False-80"]["mma"] > 0 and got[f"{dtype}-False-80"]["wgmma"] == 0
        assert got[f"{dtype}-False-90"]["wgmma"] > 0
        assert got[f"{dtype}-False-80"]["mma_types"] == got[f"{dtype}-False-90"]["mma_types"] == [t]
        for arch in (80, 90):
            assert got[f"{dtype}-True-{arch}"] == dict(mma=0, wgmma=0, mma_types=[])


_INDUCTOR_FLOATS = '''
import json
from bridge import aot
from bridge.kernels import chunk, fused_recurrent

plan = dict(aot._variants())["all-bfloat16"]
out = {}
for stage, launches, dtypes in aot._stages([fused_recurrent, chunk], plan):
    for launch in launches:
        ptx = aot._compile(launch, dtypes, 90, floats="fp64").asm["ptx"]
        out[f"{stage} {launch.kernel.__name__}"] = [
            line.strip() for line in ptx.splitlines()
            if ".f64" in line and not line.strip().startswith((".param", "cvt."))]
print(json.dumps(out))
'''


def test_every_launch_compiles_with_floats_typed_fp64_as_inductor_types_them(tmp_path):
    """Under torch.compile on CUDA, Inductor types a Triton kernel's Python float
    arguments fp64 (torch._inductor.codegen.triton_utils.signature_of), where Triton's
    own launcher types them fp32. Every launch of both families (every gate, both
    backward lists) builds so, and does no fp64 arithmetic: the float is pinned to fp32
    on entry (an fp64 `scale` once made the fused backward's loop-carried b_dh fp64,
    which does not compile)."""
    (tmp_path / "floats.py").write_text(textwrap.dedent(_INDUCTOR_FLOATS))
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, str(tmp_path / "floats.py")], env=env,
                         capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-4000:]
    got = json.loads(res.stdout.splitlines()[-1])
    assert {k.split()[1] for k in got} >= {"fused_recurrent_bwd_dkv_kernel",
                                           "chunk_output_kernel", "chunk_dqk_kernel"}
    assert all(not f64 for f64 in got.values()), {k: v[:3] for k, v in got.items() if v}


# ---------------------------------------------------------------- SASS and trip counts

def _nvdisasm():
    try:
        from bridge import sass

        return os.path.exists(sass.tool("nvdisasm"))
    except Exception:
        return False


needs_nvdisasm = pytest.mark.skipif(
    not _nvdisasm(), reason="Triton's bundled nvdisasm is missing (no NVIDIA backend)")

_LOOPS = '''
import triton
import triton.language as tl


@triton.jit
def loop_toy(x, N, ACTIVE, R, y, M: tl.constexpr):
    pid = tl.program_id(0)
    if pid >= ACTIVE:
        return
    o = tl.arange(0, M)
    acc = tl.zeros([M], dtype=tl.float32)
    for i in range(N):
        acc += tl.exp2(tl.load(x + i * M + o))
        for s in tl.static_range(2):
            acc = tl.exp2(acc * 0.5)
        for j in range(pid % R):
            acc = tl.exp2(acc - tl.max(acc, 0))
    tl.store(y + pid * M + o, acc)


@triton.jit
def small_toy(x, N, y, M: tl.constexpr):
    o = tl.arange(0, M)
    acc = tl.zeros([M], dtype=tl.float32)
    for i in range(N):
        acc += tl.exp2(tl.load(x + i * M + o))
    tl.store(y + tl.program_id(0) * M + o, acc)
'''

_RUN_LOOPS = '''
import json
from bridge import aot, sass, tripcounts
from bridge.launch import Launch, Out
from loops_toy import loop_toy, small_toy

def analyze(kernel, grid, scalars, M, W):
    launch = Launch(kernel, grid, dict(x="q"), scalars, dict(y=Out("y", (grid[0], M))), dict(M=M),
                    num_warps=W)
    k = aot._compile(launch, dict(q="float32", y="float32"), 90)
    tc = tripcounts.trip_counts(kernel, grid, aot.launch_params(launch))
    blind = sass.analyze(k.asm["cubin"], k.asm["ptx"], None, W, programs=grid[0])
    return dict(sass.analyze(k.asm["cubin"], k.asm["ptx"], tc, W).as_dict(),
                blind=blind.as_dict())

print(json.dumps(dict(big=analyze(loop_toy, (12,), dict(N=37, ACTIVE=10, R=3), 1024, 4),
                      small=analyze(small_toy, (3,), dict(N=37), 128, 4))))
'''


@needs_nvdisasm
def test_sass_dynamic_counts_match_closed_form(tmp_path):
    """The SASS reader on two hand-written kernels compiled for sm_90, against
    closed forms. loop_toy: 12 programs of 4 warps, 2 return at once (pid >= 10);
    the rest run N = 37 outer iterations with 1 + 2 (static_range) exp2 of 1024
    elements (8 per thread) and pid % 3 inner iterations with 1 exp2 and a
    cross-warp max: MUFU.EX2 = 4 x (24 x 37 x 10 + 8 x 37 x sum(pid % 3)), the
    inner loop's bar.sync = 4 x its static count x 37 x 9. small_toy's tiny body
    is unrolled 4x by ptxas: the reader finds the factor, and its estimate lies
    between the exact count and the exact count plus the 3 peeled copies."""
    (tmp_path / "loops_toy.py").write_text(textwrap.dedent(_LOOPS))
    (tmp_path / "run.py").write_text(textwrap.dedent(_RUN_LOOPS))
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join([ROOT, str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, str(tmp_path / "run.py")], env=env, capture_output=True,
                         text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-4000:]
    got = json.loads(res.stdout.splitlines()[-1])
    big = got["big"]
    inner_runs = 37 * sum(p % 3 for p in range(10))
    assert big["dynamic_classes"]["MUFU.EX2"] == 4 * (24 * 37 * 10 + 8 * inner_runs)
    loops = {lp["line"]: lp for lp in big["loops"]}
    assert set(loops) == {"loops_toy.py:13", "loops_toy.py:17"}  # static_range: no SASS loop
    outer, inner = loops["loops_toy.py:13"], loops["loops_toy.py:17"]
    assert (outer["runs"], inner["runs"]) == (370, inner_runs)
    assert inner["parent"] == big["loops"].index(outer) and inner["depth"] == 1
    assert inner["classes"]["BAR"] > 0 and inner["classes"]["MUFU.EX2"] == 8
    assert big["dynamic_classes"]["BAR"] == 4 * inner["classes"]["BAR"] * inner_runs
    assert outer["classes_nested"]["BAR"] == inner["classes"]["BAR"]
    assert any("2 of 12 programs return early" in n for n in big["notes"])
    small = got["small"]
    main = [lp for lp in small["loops"] if lp["runs"]]
    assert len(main) == 1 and "ptxas unroll 4" in main[0]["trips"], small["loops"]
    exact = 37 * 4 * 3  # N x warps x programs, one exp2 per thread
    assert exact <= small["dynamic_classes"]["MUFU.EX2"] <= exact + 3 * 4 * 3
    # without trip counts every instruction runs once per program and warp, and says so
    blind = big["blind"]
    assert blind["dynamic"] == 4 * 12 * blind["instructions"]
    assert any("lower bound" in n for n in blind["notes"])


def test_occupancy_arithmetic():
    """CTAs per SM by hand: registers are allocated per warp in 256s, shared
    memory has 1 KiB reserved per CTA, at most 64 warps and 32 CTAs."""
    from bridge.sass import occupancy

    # 168 regs -> 5376 per warp -> 12 warps of 65536 -> 3 CTAs of 4 warps
    assert occupancy(168, 16384, 4, 90)["ctas"] == 3
    assert occupancy(168, 16384, 4, 90)["limiter"] == "regs"
    assert occupancy(255, 6144, 8, 90)["ctas"] == 1            # 8192 per warp -> 8 warps
    assert occupancy(32, 100 * 1024, 4, 90) == dict(
        ctas=2, limiter="smem", by=dict(regs=16, smem=2, warps=16, ctas=32), warps_per_sm=8)
    assert occupancy(32, 100 * 1024, 4, 80)["ctas"] == 1       # 164 KiB per SM on sm_80
    assert occupancy(16, 0, 1, 90)["ctas"] == 32               # the CTA limit
    assert occupancy(64, 0, 16, 90)["by"]["warps"] == 4


_SKELETON = '''
import triton
import triton.language as tl


@triton.jit
def helper(n):
    s = 0
    for t in range(n):
        s += 1
    return s


@triton.jit
def shape_toy(x, cu, T, N, y, BT: tl.constexpr, NC: tl.constexpr, VARLEN: tl.constexpr):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_i = i_c % NC
    if i_c // NC >= N:
        return
    if VARLEN:
        T = tl.load(cu + 1) - tl.load(cu)
    nt = tl.cdiv(T, BT)
    for j in range(0, i_i):
        for k in range(j, i_i):
            tl.store(y + k, tl.load(x + j))
    for it in range(nt):
        for s in tl.static_range(NC):
            tl.store(y + s, it)
    n = helper(i_i)
'''


def test_trip_counts_by_hand(tmp_path, monkeypatch):
    """bridge.tripcounts runs a kernel's control flow per program: triangular
    nested loops, static_range, a helper's loop, an early return, and a loop
    bound from a loaded value (cu_seqlens) reported as not derivable."""
    from bridge import tripcounts

    (tmp_path / "skeleton_toy.py").write_text(textwrap.dedent(_SKELETON))
    monkeypatch.syspath_prepend(str(tmp_path))
    import skeleton_toy

    NC, T, BT, N = 4, 200, 64, 3
    params = dict(x=tripcounts.UNKNOWN, cu=None, T=T, N=N, y=tripcounts.UNKNOWN, BT=BT, NC=NC,
                  VARLEN=False)
    grid = (NC * (N + 1), 5)  # the last NC programs along x return at once
    tc = tripcounts.trip_counts(skeleton_toy.shape_toy, grid, params)
    assert tc.programs == NC * (N + 1) * 5
    active = N * 5  # programs per value of i_i that do not return
    key = lambda line: ("skeleton_toy.py", line)  # noqa: E731
    # line numbers of _SKELETON as written to the file (it starts with a newline)
    assert tc.per_program[key(23)] == active * sum(range(NC))                       # j < i_i
    assert tc.per_program[key(24)] == active * sum(i * (i + 1) // 2 for i in range(NC))
    nt = -(-T // BT)
    assert tc.per_program[key(26)] == active * NC * nt
    assert tc.per_program[key(27)] == active * NC * nt * NC
    assert tc.per_program[key(9)] == active * sum(range(NC))                        # helper
    assert tc.loops[key(27)]["kind"] == "static" and tc.loops[key(26)]["kind"] == "runtime"
    assert tc.early_exit == {key(19): NC * 5}
    assert not tc.unknown
    assert tc.evaluated == grid[0] * grid[1]  # both axes are read
    varlen = tripcounts.trip_counts(skeleton_toy.shape_toy, grid,
                                    dict(params, cu=tripcounts.UNKNOWN, VARLEN=True))
    assert varlen.unknown[key(26)] == active * NC and varlen.per_program[key(26)] == 0
    # an axis the kernel never reads is run once and weighted
    wide = tripcounts.trip_counts(skeleton_toy.helper, (7, 3), dict(n=5))
    assert (wide.evaluated, wide.per_program[key(9)]) == (1, 5 * 21)


_DTYPED = """
import triton
import triton.language as tl


@triton.constexpr_function
def pieces(op, gate):
    return 1 if gate == op else 3


@triton.jit
def dtype_toy(x, y, L: tl.constexpr):
    b = tl.load(x + tl.arange(0, 16))
    ONE: tl.constexpr = (b.dtype != tl.float32) & (y.dtype.element_ty == b.dtype)
    for i in range(0, 1 if ONE else L):
        tl.store(y + i, b.to(tl.float32))
    for j in tl.static_range(pieces(x.dtype.element_ty, tl.bfloat16)):
        tl.store(y + j, b)
"""


def test_trip_counts_follow_dtypes(tmp_path, monkeypatch):
    """A loop whose bound depends on a loaded tile's dtype or a constexpr function of
    pointer dtypes is counted from `tripcounts.pointer` arguments, and listed as
    not derivable when the tensors are left UNKNOWN."""
    from bridge import tripcounts

    (tmp_path / "dtype_toy.py").write_text(_DTYPED)
    monkeypatch.syspath_prepend(str(tmp_path))
    import dtype_toy

    key = lambda line: ("dtype_toy.py", line)  # noqa: E731
    P = tripcounts.pointer
    counts = {}
    for x, y in (("bf16", "bfloat16"), ("float32", "float32"), ("bf16", "fp32")):
        tc = tripcounts.trip_counts(dtype_toy.dtype_toy, (3,), dict(x=P(x), y=P(y), L=5))
        assert not tc.unknown
        counts[x, y] = (tc.mean(key(15)), tc.mean(key(17)))
    assert counts == {("bf16", "bfloat16"): (1, 1), ("float32", "float32"): (5, 3),
                      ("bf16", "fp32"): (5, 1)}
    blind = tripcounts.trip_counts(dtype_toy.dtype_toy, (3,),
                                   dict(x=tripcounts.UNKNOWN, y=tripcounts.UNKNOWN, L=5))
    assert blind.unknown[key(15)] == 3


def test_targets_and_readiness_section(bf16_report):
    """The report's issue-30 targets and BENCHMARKS.md's GPU-readiness rendering:
    without fla the comparisons are "not measured"; given fla records (here our own
    launches standing in for fla's) the dynamic targets compare the sums (1.00x,
    met) and the bar.sync target the worst loop bodies."""
    import copy

    from parity.bench import readiness

    rep, _ = bf16_report
    ts = {t["name"]: t for t in rep["targets"]}
    assert len(ts) == 5 and all(t["met"] is None for n, t in ts.items() if "fla" in n)
    ctas = next(t for n, t in ts.items() if "CTAs" in n)
    low = [r for r in rep["launches"] if r["target"] == "sm_90"
           and not aot.sequential(r["kernel"]) and r["ctas_per_sm"] < 2]
    assert ctas["met"] == (not low)
    text = readiness.section({"gpu": [rep]})
    assert "Instruction model" in text and "not measured" in text
    twin = copy.deepcopy(rep)
    twin["fla"] = dict(launches=[r for r in twin["launches"] if r["target"] == "sm_90"],
                       dynamic={}, versions=dict(fla="0"))
    got = {t["name"]: t for t in aot.targets(twin)}
    dyn = [t for n, t in got.items() if "dynamic" in n]
    assert len(dyn) == 2 and all(t["met"] and "(1.00x)" in t["figure"] for t in dyn)
    bars = next(t for n, t in got.items() if "bar.sync" in n)
    assert bars["met"] and str(max(aot.max_loop_bars(r) for r in twin["fla"]["launches"])) \
        in bars["figure"]
    assert aot.sequential("chunk_state_kernel") and aot.sequential("chunk_bwd_kernel_dh")
    assert aot.sequential("chunk_fwd_kernel_h") and not aot.sequential("chunk_dqk_kernel")


_FLA = '''
import json
from bridge import aot_fla

entries = aot_fla.capture((1, 128, 2, 64, 64))
inter = next(e for e in entries if e["fn"].__name__ == "chunk_gla_fwd_A_kernel_intra_sub_inter")
rec = aot_fla.compile_config(inter, inter["configs"][0])
print(json.dumps(dict(
    launches=[[e["phase"], e["fn"].__name__, len(e["configs"])] for e in entries],
    bks=sorted({c.kwargs.get("BK") for e in entries for c in e["configs"]
                if c and "BK" in c.kwargs}),
    rec={k: rec[k] for k in ("kernel", "grid", "programs", "num_warps", "dynamic", "ctas_per_sm")},
    exits=rec["sass_notes"])))
'''


@needs_nvdisasm
def test_fla_launches_are_captured(tmp_path):
    """--compare-fla's capture of fla's chunk_gla (forward with final state, backward)
    under the H100 stand-in: the launch sequence fla/ops/gla/chunk.py makes
    (cumsum, state, intra-chunk, output; backward recomputing cumsum and h), its
    H100 tile sizes (BK 32 and 64, not the CPU fallback 16 / 32), and one config of
    the inter-sub-chunk kernel compiled: grid (chunks, 4 x 4 sub-chunk pairs, B x H),
    the 10 of 16 pairs with i <= j returning at once."""
    pytest.importorskip("fla", reason="fla-core (the bench extra) is not installed")
    (tmp_path / "run.py").write_text(textwrap.dedent(_FLA))
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, str(tmp_path / "run.py")], env=env, capture_output=True,
                         text=True, timeout=600, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-4000:]
    got = json.loads(res.stdout.splitlines()[-1])
    names = [(p, n) for p, n, _ in got["launches"]]
    assert names == [
        ("fwd", "chunk_local_cumsum_vector_kernel"), ("fwd", "chunk_fwd_kernel_h"),
        ("fwd", "chunk_gla_fwd_A_kernel_intra_sub_inter"),
        ("fwd", "chunk_gla_fwd_A_kernel_intra_sub_intra"), ("fwd", "chunk_gla_fwd_kernel_o"),
        ("bwd", "chunk_local_cumsum_vector_kernel"), ("bwd", "chunk_fwd_kernel_h"),
        ("bwd", "chunk_bwd_kernel_dh"), ("bwd", "chunk_gla_bwd_kernel_dv"),
        ("bwd", "chunk_gla_bwd_kernel_dA"), ("bwd", "chunk_gla_bwd_kernel_intra"),
        ("bwd", "chunk_gla_bwd_kernel_inter")], names
    assert all(n >= 1 for _, _, n in got["launches"]) and got["bks"] == [32, 64]
    rec = got["rec"]
    assert rec["grid"] == [2, 16, 2] and rec["programs"] == 64 and rec["dynamic"] > 0
    assert any("40 of 64 programs return early" in n for n in got["exits"]), got["exits"]
