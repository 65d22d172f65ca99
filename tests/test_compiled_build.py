"""parity.compiled's pieces on toy kernels with closed forms: the tensor-core
instructions counted in the PTX, every launch compiled with floats typed as Inductor
types them, the SASS dynamic counts, occupancy, and trip counts by hand (each build in
a subprocess with TRITON_INTERPRET=0: this process may run Triton's interpreter)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

import bridge.kernels  # noqa: E402,F401  (decides the interpreter before triton is imported)
from parity.compiled import sass  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


_TOY = '''
import json, sys
import triton, triton.language as tl
from parity.compiled import build
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
            k = build.compile_source(launch, dict(q=dtype, k=dtype, c="float32"), arch)
            out[f"{dtype}-{ieee}-{arch}"] = build.count_mma(k.asm["ptx"])
print(json.dumps(out))
'''


def _compiled_json(tmp_path, source, timeout):
    """Run `source` (a script printing JSON last) with TRITON_INTERPRET=0; its JSON."""
    (tmp_path / "script.py").write_text(textwrap.dedent(source))
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, str(tmp_path / "script.py")], env=env,
                         capture_output=True, text=True, timeout=timeout, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout.splitlines()[-1])


def test_count_mma_on_a_compiled_dot(tmp_path):
    """count_mma on real PTX: a 64x64x64 bf16/fp16 tl.dot is mma.sync on sm_80
    and wgmma on sm_90 (4 warps, M = 64), of the operands' type; an fp32 "ieee"
    product has no tensor-core instruction."""
    got = _compiled_json(tmp_path, _TOY, timeout=300)
    for dtype, t in (("bfloat16", "bf16"), ("float16", "f16")):
        assert got[f"{dtype}-False-80"]["mma"] > 0 and got[f"{dtype}-False-80"]["wgmma"] == 0
        assert got[f"{dtype}-False-90"]["wgmma"] > 0
        assert got[f"{dtype}-False-80"]["mma_types"] == got[f"{dtype}-False-90"]["mma_types"] == [t]
        for arch in (80, 90):
            assert got[f"{dtype}-True-{arch}"] == dict(mma=0, wgmma=0, mma_types=[])


_INDUCTOR_FLOATS = '''
import json
from parity.compiled import build
from bridge.kernels import chunk, fused_chunk, fused_recurrent

plan = dict(build.variants())["all-bfloat16"]
out = {}
for stage, launches, dtypes in build.stages([fused_recurrent, chunk, fused_chunk], plan):
    for launch in launches:
        ptx = build.compile_source(launch, dtypes, 90, floats="fp64").asm["ptx"]
        out[f"{stage} {launch.kernel.__name__}"] = [
            line.strip() for line in ptx.splitlines()
            if ".f64" in line and not line.strip().startswith((".param", "cvt."))]
print(json.dumps(out))
'''


def test_every_launch_compiles_with_floats_typed_fp64_as_inductor_types_them(tmp_path):
    """Under torch.compile on CUDA, Inductor types a Triton kernel's Python float
    arguments fp64 (torch._inductor.codegen.triton_utils.signature_of), where Triton's
    own launcher types them fp32. Every launch of every family (every gate, both
    backward lists) builds so, and does no fp64 arithmetic: the float is pinned to fp32
    on entry (an fp64 `scale` once made the fused backward's loop-carried b_dh fp64,
    which does not compile)."""
    got = _compiled_json(tmp_path, _INDUCTOR_FLOATS, timeout=900)
    assert {k.split()[1] for k in got} >= {"fused_recurrent_bwd_dkv_kernel",
                                           "chunk_output_kernel", "chunk_dqk_kernel",
                                           "fused_chunk_fwd_kernel"}
    assert all(not f64 for f64 in got.values()), {k: v[:3] for k, v in got.items() if v}


# ---------------------------------------------------------------- SASS and trip counts

needs_nvdisasm = pytest.mark.skipif(
    not sass.has_nvdisasm(), reason="Triton's bundled nvdisasm is missing (no NVIDIA backend)")

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
from parity.compiled import build, sass, tripcounts
from bridge.launch import Launch, Out
from loops_toy import loop_toy, small_toy

def analyze(kernel, grid, scalars, M, W):
    launch = Launch(kernel, grid, dict(x="q"), scalars, dict(y=Out("y", (grid[0], M))), dict(M=M),
                    num_warps=W)
    k = build.compile_source(launch, dict(q="float32", y="float32"), 90)
    tc = tripcounts.trip_counts(kernel, grid, build.launch_params(launch))
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
    from parity.compiled.sass import occupancy

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
    """parity.compiled.tripcounts runs a kernel's control flow per program: triangular
    nested loops, static_range, a helper's loop, an early return, and a loop
    bound from a loaded value (cu_seqlens) reported as not derivable."""
    from parity.compiled import symbolic, tripcounts

    (tmp_path / "skeleton_toy.py").write_text(textwrap.dedent(_SKELETON))
    monkeypatch.syspath_prepend(str(tmp_path))
    import skeleton_toy

    NC, T, BT, N = 4, 200, 64, 3
    params = dict(x=symbolic.UNKNOWN, cu=None, T=T, N=N, y=symbolic.UNKNOWN, BT=BT, NC=NC,
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
                                    dict(params, cu=symbolic.UNKNOWN, VARLEN=True))
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
    pointer dtypes is counted from `symbolic.pointer` arguments, and listed as
    not derivable when the tensors are left UNKNOWN."""
    from parity.compiled import symbolic, tripcounts

    (tmp_path / "dtype_toy.py").write_text(_DTYPED)
    monkeypatch.syspath_prepend(str(tmp_path))
    import dtype_toy

    key = lambda line: ("dtype_toy.py", line)  # noqa: E731
    P = symbolic.pointer
    counts = {}
    for x, y in (("bf16", "bfloat16"), ("float32", "float32"), ("bf16", "fp32")):
        tc = tripcounts.trip_counts(dtype_toy.dtype_toy, (3,), dict(x=P(x), y=P(y), L=5))
        assert not tc.unknown
        counts[x, y] = (tc.mean(key(15)), tc.mean(key(17)))
    assert counts == {("bf16", "bfloat16"): (1, 1), ("float32", "float32"): (5, 3),
                      ("bf16", "fp32"): (5, 1)}
    blind = tripcounts.trip_counts(dtype_toy.dtype_toy, (3,),
                                   dict(x=symbolic.UNKNOWN, y=symbolic.UNKNOWN, L=5))
    assert blind.unknown[key(15)] == 3


# ---------------------------------------------------------------- fused_chunk's 16-bit plans

# The builds below are of (B, T, H) = (1, 64, 16), the reference plan's heads: H, a
# constexpr, compiles into every address and ptxas allocates differently by it (bf16's
# forward with a head gate at K = V = 96 on sm_90 on 128-key blocks spilled 12 B at 16
# heads and none at 2); B and T (a runtime scalar, hinted as a multiple of 16 either
# way) change no build.

# The 16-bit forward at 255 registers (with per-key decays sm_90's pipelined bf16 on all of
# V at 8 warps and sm_80's lean tiles at 4; with decays the same for every key the
# pipelined tiles at 4): ptxas keeps values that live across the chunk loop (from the
# thread index, for the final state's store) in local memory, stored before the loop and
# loaded after it, never inside it; by (arch, dtype, gates, K = V, whether the forward
# keeps A for the backward: fused_chunk.kept; on sm_90 it stores A^T and spills none
# short of K = 100), the most under any supported Triton; and so gv beside decays the
# same for every key (8 warps on sm_90; 4 in fp16 on sm_80 at K <= 64)
_POST_LOOP_FWD_SPILLS = {(90, "bf16", "key", 96, False): 12, (90, "bf16", "key", 128, False): 12,
                         (80, "bf16", "key", 96, False): 36, (80, "fp16", "key", 96, False): 48,
                         (80, "fp16", "key", 128, False): 24,
                         (90, "fp16", "gamma", 96, False): 12,
                         (80, "bf16", "key", 96, True): 48, (80, "fp16", "key", 96, True): 24,
                         (80, "fp16", "key", 128, True): 24,
                         **{(a, d, g, kv, False): b for a, d, g, kv, b in (
                             (90, "bf16", "head+gv", 96, 36), (90, "bf16", "head+gv", 128, 60),
                             (90, "bf16", "gamma+gv", 32, 20), (90, "bf16", "gamma+gv", 64, 24),
                             (90, "bf16", "gamma+gv", 96, 48), (90, "bf16", "gamma+gv", 128, 60),
                             (90, "fp16", "head+gv", 32, 12), (90, "fp16", "head+gv", 64, 24),
                             (90, "fp16", "gamma+gv", 64, 24), (90, "fp16", "gamma+gv", 128, 60),
                             (80, "fp16", "head+gv", 32, 12), (80, "fp16", "head+gv", 64, 12),
                             (80, "fp16", "gamma+gv", 32, 24), (80, "fp16", "gamma+gv", 64, 12))},
                         # keys short of their block (K = V = 100: 8-byte loads, its rows
                         # 200 B apart)
                         **{(a, d, g, 100, keep): b for a, d, g, keep, b in (
                             (80, "bf16", "key", False, 24), (80, "bf16", "gamma", False, 48),
                             (80, "bf16", "gv", False, 24), (80, "bf16", "all", False, 12),
                             (80, "fp16", "gamma", False, 24), (80, "fp16", "all", False, 48),
                             (90, "bf16", "key", False, 24), (90, "bf16", "key", True, 24),
                             (90, "bf16", "gamma", False, 12),
                             (90, "bf16", "gamma+gv", False, 36),
                             (90, "fp16", "key", True, 12), (90, "fp16", "head+gv", False, 36))}}

# ... and at K = V = 100 the plans that spill inside the chunk loop too: (bytes, local-memory
# instructions inside a loop), the most under any supported Triton: sm_80's lean tiles
# with per-key decays on 16-token chunks, and under triton 3.6 on sm_90 gv beside a head
# gate (bf16) or g_gamma (fp16; 12 B outside the loop under 3.7); the spill-free tiles a
# sweep found ran longer in the time model or spilled at other K (BENCHMARKS.md, "keys
# short of their block"). And under triton 3.6 on sm_80 fp16's gv beside per-key decays
# at K = V = 96 and 128 (none under 3.7)
_IN_LOOP_FWD_SPILLS = {(80, "bf16", "key", 100, True): (100, 5),
                       (80, "fp16", "key", 100, False): (92, 4),
                       (80, "fp16", "key", 100, True): (164, 13),
                       (90, "bf16", "head+gv", 100, False): (68, 4),
                       (90, "fp16", "gamma+gv", 100, False): (52, 2),
                       (80, "fp16", "key+gv", 96, False): (84, 3),
                       (80, "fp16", "key+gv", 128, False): (84, 3)}

_FUSED_CHUNK_16 = '''
import json
from parity.compiled import build, report
from bridge.kernels import family

fam = family("fused_chunk")
out = []
with build.for_arch(90):  # sm_90's own tiles (tuning.wgmma)
    for dtype in ("bf16", "fp16"):
        for gates in ("key", "head", "none", "gamma", "all"):
            if dtype == "fp16" and gates == "all":
                continue  # spills (SPEC.md): its state and A products in fp32
            for KV in (64, 128):
                plan = report.report_plan((1, 64, 16, KV, KV), dtype, gates)
                # the forward and backward as autograd runs them, and the forward without
                # a backward where it differs (it keeps no A)
                fwd, infer = fam.forward_launches(plan), fam.forward_launches(plan, keep=False)
                launches = (fwd + (infer if infer != fwd else [])
                            + fam.backward_launches(plan, True, fam.kept(plan)))
                dtypes = build.tensor_dtypes(plan, [launches])
                for launch in launches:
                    r = build.compile_launch(launch, plan, 90, dtypes=dtypes)
                    c = launch.constexprs
                    name = launch.kernel.__name__ + (".dv" if c.get("DV") else "")
                    out.append([dtype, gates, KV, name, launch.num_warps, c.get("BV"),
                                c.get("BT"), r["regs"], r["spill_bytes"],
                                bool(c.get("KEEP_A") or c.get("BTF"))])
print(json.dumps(out))
'''


@pytest.mark.matrix
def test_fused_chunk_16bit_plans_build_without_spills_on_sm90(tmp_path):
    """fused_chunk's launches (forward and its backward, on chip or the chunk family's
    list) at K = V = 64 and 128, bf16 with every gate kind and fp16 short of every gate,
    build for sm_90 with sm_90's tiles without spills (one exception below): the bf16
    forward without gv ("lean": fused_chunk.config) at 4 warps (two programs a SM:
    registers <= 255 at 128 threads) but with per-key or no decays, there all of V at
    8 warps, and so fp16's forward (with per-key decays on 16-token chunks at V = 128),
    with decays the same for every key (a head gate, g_gamma) on 32-wide V blocks;
    the dq and dk walks at 4 warps on 16-token chunks (8 for fp16's g_gamma at 128), the
    dv walk on all of V at 8 on 32-token chunks (16 in fp16 with key decays at 128), with
    per-key decays from the A the forward keeps. The forward with per-key decays at K = V
    = 128 spills only the bytes `_POST_LOOP_FWD_SPILLS` allows (outside its loop: the
    16-bit forward test checks)."""
    got = _compiled_json(tmp_path, _FUSED_CHUNK_16, timeout=1800)
    assert len({(d, g, kv) for d, g, kv, *_ in got}) == 18
    spilled = [row for row in got if row[8] != 0 and not (
        row[3] == "fused_chunk_fwd_kernel"
        and row[8] <= _POST_LOOP_FWD_SPILLS.get((90, *row[:3], row[9]), 0))]
    assert not spilled, spilled
    kept = {(d, g, kv, name) for d, g, kv, name, *_, keep in got if keep}
    assert kept == {(d, "key", kv, n) for d in ("bf16", "fp16") for kv in (64, 128)
                    for n in ("fused_chunk_fwd_kernel", "fused_chunk_bwd_dkv_kernel.dv")}
    lean = {(g, kv): (w, bv) for d, g, kv, name, w, bv, bt, *_ in got
            if d == "bf16" and g != "all" and name == "fused_chunk_fwd_kernel"}
    assert len(lean) == 8
    assert lean == {(g, kv): (8, kv) if g in ("key", "none") else (4, 32) for g, kv in lean}
    lean16 = {(g, kv): (w, bv) for d, g, kv, name, w, bv, bt, *_ in got
              if d == "fp16" and g in ("head", "gamma") and name == "fused_chunk_fwd_kernel"}
    assert lean16 == {(g, kv): lean[g, kv] for g, kv in lean16}  # fp16's as bf16's
    whole16 = {(g, kv): (w, bv, bt) for d, g, kv, name, w, bv, bt, *_ in got
               if d == "fp16" and g in ("key", "none") and name == "fused_chunk_fwd_kernel"}
    assert whole16 == {("key", 64): (8, 64, 32), ("none", 64): (8, 64, 32),
                       ("key", 128): (8, 128, 16), ("none", 128): (8, 128, 32)}
    wide_gamma16 = lambda d, g, kv: d == "fp16" and g == "gamma" and kv > 64  # noqa: E731
    walks = {(name, w, bv if name.endswith(".dv") else None, bt)
             for d, g, kv, name, w, bv, bt, *_ in got
             if name.startswith("fused_chunk_bwd_") and "combine" not in name
             and not (wide_gamma16(d, g, kv) and not name.endswith(".dv"))}
    dq, dkv = "fused_chunk_bwd_dq_kernel", "fused_chunk_bwd_dkv_kernel"
    assert walks == {(dq, 4, None, 16), (dkv, 4, None, 16), (dkv + ".dv", 8, 64, 32),
                     (dkv + ".dv", 8, 128, 32), (dkv + ".dv", 8, 128, 16)}
    dv16 = {(g, bt) for d, g, kv, name, w, bv, bt, *_ in got
            if d == "fp16" and kv == 128 and name == dkv + ".dv"}
    assert dv16 == {("key", 16), ("head", 16), ("gamma", 16), ("none", 32)}
    gamma16 = {(name, w, bt) for d, g, kv, name, w, bv, bt, *_ in got
               if wide_gamma16(d, g, kv) and name in (dq, dkv)}
    assert gamma16 == {(dq, 8, 16), (dkv, 8, 16)}  # 4 warps spilled


# The dv walk on sm_90 (all of V, 8 warps) with keys short of their power-of-two block, on
# 32-token chunks (16 in fp16 with key decays past 64 keys: fused_chunk_bwd.config)
_DV_MASKED_KEYS = '''
import json
from parity.compiled import build, report
from bridge.kernels import fused_chunk, fused_chunk_bwd

out = []
with build.for_arch(90):
    for dtype, gates in (("bf16", "key"), ("bf16", "gamma"), ("fp16", "gamma"), ("bf16", "head")):
        for K, V in ((68, 68), (98, 98), (100, 80), (96, 128), (96, 96)):
            plan = report.report_plan((1, 64, 16, K, V), dtype, gates)
            kept = fused_chunk.kept(plan)  # with per-key decays also the dv walk of the kept A
            for keep in {(), kept}:
                launch = [x for x in fused_chunk.backward_launches(plan, True, keep)
                          if x.constexprs.get("DV")][0]
                dtypes = build.tensor_dtypes(plan, [fused_chunk.forward_launches(plan), [launch]])
                r = build.compile_launch(launch, plan, 90, dtypes=dtypes)
                out.append([dtype, gates, K, V, launch.constexprs["BT"], bool(keep),
                            r["spill_bytes"]])
print(json.dumps(out))
'''


@pytest.mark.matrix
def test_fused_chunk_dv_walk_with_masked_keys_builds_without_spills_on_sm90(tmp_path):
    """fused_chunk's dv walk on sm_90 with K short of its power-of-two block (68, 96, 98,
    100) beside V = K, fewer and more values, bf16 and fp16, per-key and per-head decays
    (per-key: A built in the walk and the A the forward kept): no spills, bf16 on
    32-token chunks (before its A came from the forward's construction, intra.py,
    32-token chunks spilled 8-104 B in the loop there under triton 3.6.0 or 3.7.1 where
    the keys were not in whole 16-column pieces or fewer than the values)."""
    got = _compiled_json(tmp_path, _DV_MASKED_KEYS, timeout=900)
    assert len(got) == 25 and {(g, K, V) for d, g, K, V, bt, keep, _ in got if keep} == {
        ("key", 68, 68), ("key", 98, 98), ("key", 100, 80), ("key", 96, 128), ("key", 96, 96)}
    assert [row for row in got if row[-1]] == []
    assert {(d, bt) for d, g, K, V, bt, *_ in got} == {("bf16", 32), ("fp16", 16)}


# fused_chunk's walks on sm_80 (mma.sync: operands in registers; the CPU's plans too):
# the dq and dk walks on K blocks of 32 or 64, the dv walk on 32-wide V blocks (A the
# forward's construction, intra.py), 16-token chunks, pipelined where that builds
_WALKS_SM80 = '''
import dataclasses, json
from parity.compiled import build, report
from bridge.kernels import fused_chunk, fused_chunk_bwd

out = []
with build.for_arch(80):
    for dtype in ("bf16", "fp16"):
        for gates in ("key", "head", "none", "gamma", "gk", "head+gk"):
            shapes = (((128, 128), (100, 100), (64, 64), (50, 50), (100, 64))
                      if "+" not in gates else ((64, 64), (50, 50)))
            for K, V in shapes:
                plan = report.report_plan((1, 64, 16, K, V), dtype,
                                          "none" if "gk" in gates else gates)
                if "gk" in gates:
                    plan = dataclasses.replace(plan, gk=True, g="head" if "+" in gates else "none")
                # A built in the dv walk, and (".dv-kept") the dv walk of the kept A
                launches = fused_chunk_bwd.launches(plan, True)
                if fused_chunk.kept(plan):
                    launches += [x for x in fused_chunk.backward_launches(
                        plan, True, fused_chunk.kept(plan)) if x.constexprs.get("DV")]
                dtypes = build.tensor_dtypes(plan, [fused_chunk.forward_launches(plan),
                                                    launches])
                for launch in launches:
                    r = build.compile_launch(launch, plan, 80, dtypes=dtypes)
                    c = launch.constexprs
                    name = launch.kernel.__name__ + (".dv-kept" if c.get("BTF") else
                                                     ".dv" if c.get("DV") else "")
                    out.append([dtype, gates, K, V, name, launch.num_warps, c.get("BK"),
                                c.get("BV"), c.get("STAGES"), r["spill_bytes"]])
print(json.dumps(out))
'''


@pytest.mark.matrix
def test_fused_chunk_walks_build_without_spills_on_sm80(tmp_path):
    """fused_chunk's backward on sm_80, every launch (the dq, dk and dv walks and the
    combine), bf16 and fp16, per-key, per-head, no decays, g_gamma (on chip off sm_90
    too) and gk alone at K x V = 128, 100, 64, 50 square and 100 x 64, g and gk together
    at 64 and 50: no spills; the dq and dk walks on 32-key blocks beside V under 128 and
    with g_gamma (on 64 they spilled 248-1416 B pipelined with per-key decays and
    268-1124 B with g_gamma, 8 B with a head gate at K = 50), the walks pipelined but the
    dv walk with per-key decays past 64 keys or g and gk together (1.0-1.9 KB, 56-224 B)
    and fp16's dk walk with per-key decays past 96 keys; with per-key decays the dv walk
    that loads the A the forward kept pipelined everywhere (".dv-kept")."""
    got = _compiled_json(tmp_path, _WALKS_SM80, timeout=1800)
    assert len({tuple(row[:4]) for row in got}) == 2 * (5 * 5 + 2)
    assert [row for row in got if row[-1]] == []
    walks = {(d, g, K, V, n): (bk, st) for d, g, K, V, n, w, bk, bv, st, _ in got
             if n.startswith("fused_chunk_bwd_d")}
    assert walks["bf16", "key", 128, 128, "fused_chunk_bwd_dq_kernel"] == (64, 3)
    assert walks["bf16", "key", 64, 64, "fused_chunk_bwd_dq_kernel"] == (32, 3)
    assert walks["bf16", "gamma", 128, 128, "fused_chunk_bwd_dkv_kernel"] == (32, 3)
    assert walks["bf16", "key", 128, 128, "fused_chunk_bwd_dkv_kernel.dv"] == (128, 1)
    assert walks["fp16", "head+gk", 64, 64, "fused_chunk_bwd_dkv_kernel.dv"] == (64, 1)
    assert walks["bf16", "head", 128, 128, "fused_chunk_bwd_dkv_kernel.dv"] == (128, 3)
    kept = {k[:4]: st for k, (bk, st) in walks.items() if k[4].endswith(".dv-kept")}
    assert set(kept) == {(d, g, K, V) for d in ("bf16", "fp16")
                         for g in ("key", "gk") for K, V in ((128, 128), (100, 100), (64, 64),
                                                             (50, 50), (100, 64))} | {
        (d, "head+gk", K, K) for d in ("bf16", "fp16") for K in (64, 50)}
    assert set(kept.values()) == {3}


_FUSED_CHUNK_16_FWD = '''
import dataclasses, json
from parity.compiled import build, report, sass
from bridge.kernels import fused_chunk

out = []
for arch in (80, 90):
    with build.for_arch(arch):  # each arch's own tiles (tuning.wgmma)
        for dtype in ("bf16", "fp16"):
            for gates in ("key", "head", "none", "gamma", "gv", "all", "head+gv", "gamma+gv",
                          "key+gv"):
                for KV in (32, 64, 96, 100, 128):
                    plan = report.report_plan((1, 64, 16, KV, KV), dtype, gates.split("+")[0])
                    plan = dataclasses.replace(plan, gv=plan.gv or gates.endswith("+gv"))
                    for keep in (False, True) if fused_chunk.kept(plan) else (False,):
                        launches = fused_chunk.forward_launches(plan, keep=keep)
                        dtypes = build.tensor_dtypes(plan, [launches])
                        k = build.compile_source(launches[0], dtypes, arch, True)
                        spilled = build.ptxas_usage(k.asm["ptx"], arch)["spill_bytes"] or 0
                        in_loop = None  # local-memory instructions inside a loop of the SASS
                        if spilled:
                            ins, labels = sass.parse(sass.disassemble(k.asm["cubin"]))
                            loops = sass.find_loops(ins, labels)
                            in_loop = sum(i.op.startswith(("LDL", "STL"))
                                          and sass.innermost(loops, i.addr) >= 0 for i in ins)
                        out.append([arch, dtype, gates, KV, keep, spilled, in_loop])
print(json.dumps(out))
'''

# The 16-bit forward plans at K = V <= 128 that still spill (BENCHMARKS.md, "fused_chunk's
# 16-bit forward: the tiles where others spilled"), by Triton, but `_POST_LOOP_FWD_SPILLS`:
# none under 3.7.1; under 3.6 every gate on sm_80, where sm_80's mma.sync keeps its operands
# in registers (no spill-free tile was found)
_KNOWN_FWD_SPILLS_3_6 = {(80, d, "all", kv, False) for d in ("bf16", "fp16") for kv in (96, 128)}


@pytest.mark.matrix
def test_fused_chunk_16bit_forward_spills_only_where_known(tmp_path):
    """fused_chunk's 16-bit forward (its own config, `fused_chunk.config`) at K = V = 32,
    64, 96, 100, 128 with every gate kind, gv alone, gv beside a head gate or g_gamma (A
    from the pairs' decay sums) or a key gate, and every gate at once, built for sm_80
    and sm_90 with each arch's tiles, with per-key decays both with the A it keeps for
    the backward and without (no backward follows): no spills but under triton 3.6 in the
    plans known to (`_KNOWN_FWD_SPILLS_3_6`), at most `_POST_LOOP_FWD_SPILLS`' bytes with
    no local-memory instruction inside a loop, and at most `_IN_LOOP_FWD_SPILLS`' bytes
    and instructions inside one."""
    import triton

    got = _compiled_json(tmp_path, _FUSED_CHUNK_16_FWD, timeout=1800)
    assert len(got) == 2 * 2 * 9 * 5 + 2 * 2 * 5  # and "key" with A kept
    known = _KNOWN_FWD_SPILLS_3_6 if triton.__version__.startswith("3.6") else set()
    spilled = {tuple(row[:5]): row[5:] for row in got if row[5]}
    unknown = {p for p in spilled if p not in known and p not in _POST_LOOP_FWD_SPILLS
               and p not in _IN_LOOP_FWD_SPILLS}
    assert not unknown, sorted(unknown)
    post_loop = {p: v for p, v in spilled.items() if p in _POST_LOOP_FWD_SPILLS}
    assert all(b <= _POST_LOOP_FWD_SPILLS[p] and in_loop == 0
               for p, (b, in_loop) in post_loop.items()), post_loop
    in_loop = {p: v for p, v in spilled.items() if p in _IN_LOOP_FWD_SPILLS}
    assert all(b <= _IN_LOOP_FWD_SPILLS[p][0] and n <= _IN_LOOP_FWD_SPILLS[p][1]
               for p, (b, n) in in_loop.items()), in_loop
