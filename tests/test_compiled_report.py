"""`python -m parity.compiled --report`: what the compiled kernels are, without a GPU.

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
from parity.compiled import build, report, sass  # noqa: E402
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
    """Start `python -m parity.compiled --report *args --json` in a subprocess."""
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp / "cache"))
    return subprocess.Popen([sys.executable, "-m", "parity.compiled", "--report", *args, "--json"],
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
        assert r["lower_bound_us"] == pytest.approx(build.lower_bound(r)[0])
    # fwd: the forward as autograd runs it; fwd-infer: without a backward, where it differs
    infer = launches_of.forward_launches(plan, keep=False)
    assert {r["phase"] for r in recs} == {"fwd", "bwd"} | (
        {"fwd-infer"} if infer != launches_of.forward_launches(plan) else set())
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
    assert ws == build.workspace_bytes(plan, backward)


def _product(xs):
    n = 1
    for x in xs:
        n *= x
    return n


def test_report_structure(bf16_report):
    """Every launch has every field; both phases; bounds and workspace consistent."""
    rep, _ = bf16_report
    _check_structure(rep, report.report_plan(SMALL, "bf16"), chunk)
    assert rep["shape"] == dict(B=2, T=256, H=4, Hk=4, K=128, V=128, N=2)
    names = [r["kernel"] for r in rep["launches"] if r["target"] == "sm_90"]
    plan = report.report_plan(SMALL, "bf16")
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
    the input's type (tf32 only in a kernel whose docstring mentions tf32, bf16 in a
    16-bit kernel only where it mentions bf16 pieces).
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
        doc = _kernel_doc(r["kernel"])
        allowed = ({MMA_TYPE[dtype]} | ({"tf32"} if "tf32" in doc else set())
                   | ({"bf16"} if "bf16 pieces" in doc else set()))
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
    plan = report.report_plan(REFERENCE, "bf16")
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
    _check_structure(rep, report.report_plan(SMALL64, "bf16"), fused_recurrent)
    assert rep["mode"] == "fused_recurrent"
    for r in rep["launches"]:
        if r["dot_flops"] == 0:
            assert r["mma"] == r["wgmma"] == 0, r


def test_fused_chunk_report(tmp_path):
    """fused_chunk with per-key decays: the forward that keeps A (phase fwd) and the one
    without a backward (fwd-infer), the backward loading A; the workspace is the
    backward's; the time model's forward is fwd-infer's, its forward+backward fwd's."""
    from bridge.kernels import fused_chunk
    from parity.compiled import timemodel

    rep = _finish(_start(tmp_path, "--mode", "fused_chunk", "--shape", _shape_arg(SMALL64),
                         "--dtype", "bf16"))
    plan = report.report_plan(SMALL64, "bf16")
    _check_structure(rep, plan, fused_chunk)
    assert rep["kept"] == ["A"]
    recs = timemodel.modelled(rep["launches"])
    assert {r["phase"] for r in recs} == {"fwd", "fwd-infer", "bwd"}
    gpu = timemodel.HARDWARE["H200"]
    each = {p: sum(timemodel.launch_time(r, gpu)["total"] for r in recs if r["phase"] == p)
            for p in ("fwd", "fwd-infer", "bwd")}
    assert timemodel.totals(recs, gpu) == pytest.approx(
        {"fwd": each["fwd-infer"], "bwd": each["bwd"], "fwd+bwd": each["fwd"] + each["bwd"]})


def test_lower_bound_arithmetic():
    """max(flops / peak, bytes / 3.35e12), the peak picked from the PTX."""
    rec = dict(dot_flops=int(989e9), bytes=int(3.35e9), mma=0, wgmma=8, mma_types=["bf16"])
    assert build.lower_bound(rec) == (pytest.approx(1000.0), 989e12)
    rec.update(bytes=int(3.35e6))  # compute-bound now
    assert build.lower_bound(rec)[0] == pytest.approx(1000.0)
    rec.update(dot_flops=int(2 * 989e9))
    assert build.lower_bound(rec)[0] == pytest.approx(2000.0)
    # no mma/wgmma: fp32 FMA units (ieee fp32 products)
    fma = dict(dot_flops=int(67e9), bytes=0, mma=0, wgmma=0, mma_types=[])
    assert build.lower_bound(fma) == (pytest.approx(1000.0), 67e12)
    tf32 = dict(dot_flops=int(494.7e9), bytes=0, mma=4, wgmma=0, mma_types=["tf32"])
    assert build.lower_bound(tf32) == (pytest.approx(1000.0), 494.7e12)
    assert build.lower_bound(dict(dot_flops=0, bytes=0, mma=0, wgmma=0, mma_types=[]))[0] == 0


def test_workspace_bytes_by_hand():
    """Outs of the backward list minus the returned gradients, by hand."""
    from bridge.launch import Launch, Out

    plan = report.report_plan((1, 32, 2, 16, 8), "bf16", gates="head")
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
    assert build.workspace_bytes(plan, launches) == outs - grads


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
           and not report.sequential(r["kernel"]) and r["ctas_per_sm"] < 2]
    assert ctas["met"] == (not low)
    text = readiness.section({"gpu": [rep]})
    assert "Instruction model" in text and "not measured" in text
    twin = copy.deepcopy(rep)
    twin["fla"] = dict(launches=[r for r in twin["launches"] if r["target"] == "sm_90"],
                       dynamic={}, versions=dict(fla="0"))
    got = {t["name"]: t for t in report.targets(twin)}
    dyn = [t for n, t in got.items() if "dynamic" in n]
    assert len(dyn) == 2 and all(t["met"] and "(1.00x)" in t["figure"] for t in dyn)
    bars = next(t for n, t in got.items() if "bar.sync" in n)
    assert bars["met"] and str(max(report.max_loop_bars(r) for r in twin["fla"]["launches"])) \
        in bars["figure"]
    assert report.sequential("chunk_state_kernel") and report.sequential("chunk_bwd_kernel_dh")
    assert report.sequential("chunk_fwd_kernel_h") and not report.sequential("chunk_dqk_kernel")


_FLA = '''
import json
from parity.compiled import fla

entries = fla.capture((1, 128, 2, 64, 64))
inter = next(e for e in entries if e["fn"].__name__ == "chunk_gla_fwd_A_kernel_intra_sub_inter")
rec = fla.compile_config(inter, inter["configs"][0])
print(json.dumps(dict(
    launches=[[e["phase"], e["fn"].__name__, len(e["configs"])] for e in entries],
    bks=sorted({c.kwargs.get("BK") for e in entries for c in e["configs"]
                if c and "BK" in c.kwargs}),
    rec={k: rec[k] for k in ("kernel", "grid", "programs", "num_warps", "dynamic", "ctas_per_sm")},
    exits=rec["sass_notes"])))
'''


@pytest.mark.skipif(not sass.has_nvdisasm(), reason="Triton's bundled nvdisasm is missing "
                                                   "(no NVIDIA backend)")
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
