"""The GPU kit (`python -m parity.gpu`) in its dry run: the same orchestration on the
CPU at tiny shapes (Triton's interpreter; stand-ins for CUDA and fla, named as such).

Checked: every step runs in order under its cap and records its result; the JSON follows
the schema; the figures agree where they must (our kernels against fla's stand-ins, an
independent algorithm); every measurement is its own row with its own status, so a
failing implementation, an fla not warmed or absent, loses only its rows; fla's
autotuner winners are written and a later run given them tunes nothing; the per-kernel
times carry the instruction model's figures and the config sweep writes a device table,
with mode="auto"'s ranking of the families from the speed rows; a step made to fail, or
to hang past its cap, is recorded and the next step still runs; BENCHMARKS.md's GPU
section is rendered from the JSON alone, the rest of the file untouched. Three kit runs,
~30-70 s each here."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

from bridge import tuning
from parity.compiled import report
from parity.gpu import kernels, render
from parity.gpu.plan import DRY, STEPS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(ROOT, "BENCHMARKS.md")


def _kit(tmp, *extra):
    """Run the dry run into tmp; (process, gpu.json, the BENCHMARKS.md copy it rewrote,
    the JSON's path)."""
    md = tmp / "BENCHMARKS.md"
    shutil.copy(BENCHMARKS, md)
    proc = subprocess.run([sys.executable, "-m", "parity.gpu", "--dry-run", "--out",
                           str(tmp / "out"), "--md", str(md), *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    path = tmp / "out" / "gpu.json"
    with open(path) as f:
        return proc, json.load(f), md.read_text(), str(path)


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    return _kit(tmp_path_factory.mktemp("kit"))


def _steps(result):
    return {s["name"]: s for s in result["steps"]}


def _rows(step, kind="row"):
    return [r for r in step["rows"] if r["kind"] == kind]


def test_every_step_runs_in_order_and_records_its_result(clean):
    proc, result, _, _ = clean
    render.validate(result)
    assert result["kit"] == "dry-run" and result["stand_ins"] == list(DRY.stand_ins)
    assert [s["name"] for s in result["steps"]] == list(STEPS)
    for s in result["steps"]:
        assert s["status"] == "ok", (s["name"], s["error"])
        assert s["wall_s"] <= s["cap_s"] + 15, s["name"]
    by = _steps(result)
    m = by["machine"]["result"]
    assert m["matmul_tflops"] > 0 and m["copy_gbps"] > 0 and m["versions"]["torch"] != "absent"
    assert {k: s["status"] for k, s in by.items()} == {k: "ok" for k in STEPS}
    for s in result["steps"]:
        for r in s["rows"]:
            assert r["kind"] not in render.MEASURED or r["status"] in (
                "ok", "error", "not_warmed", "absent"), (s["name"], r)
    tests = _rows(by["correctness"], "test")  # no CUDA: tests/test_cuda.py skips itself
    assert tests and all(t["outcome"] == "skipped" for t in tests)
    assert by["correctness"]["result"]["counts"]["skipped"] == len(tests)
    # the compiled launches' property tests are in the command, with a recorded seed
    props = [t for t in tests if t["name"].startswith("test_compiled_matches_oracle")]
    assert len(props) == 6 and all("no CUDA device" in t["message"] for t in props)
    record = by["correctness"]["result"]["properties"]
    assert record["seconds_each"] == DRY.property_s and record["backends"] == {}
    assert f"--hypothesis-seed={record['seed']}" in by["correctness"]["result"]["command"]


def test_speed_times_every_implementation_and_they_agree(clean):
    by = _steps(clean[1])
    rows = _rows(by["speed"])
    timed = {(r["impl"], r["mode"]) for r in rows if r["status"] == "ok" and r["ms"] > 0}
    impls = ["ours chunk (torch)", "ours fused_recurrent (torch)", "ours fused_chunk (torch)",
             "stand-in for fla chunk_gla",
             "stand-in for fla fused_recurrent_gla", "ours fused_recurrent (jax)",
             "ours fused_recurrent (torch, synced)"]
    assert timed == {(i, m) for i in impls for m in ("fwd", "fwdbwd")}
    # ours chunked against each other implementation (fla's stand-ins: independent code)
    agree = [r["vs_ours_chunk"] for r in rows if r.get("vs_ours_chunk") is not None]
    assert len(agree) == 10 and max(agree) < 1e-5, agree
    # the implementation that fails, first in its child: its rows only
    failed = [r for r in rows if r["status"] != "ok"]
    assert {(r["impl"], r["status"]) for r in failed} == {("stand-in that fails", "error")}
    assert len(failed) == 2 and all("StandInFailure" in r["error"] for r in failed)
    same = _rows(by["speed"], "agree")  # one kernel, two launchers
    assert same and all(r["jax_vs_torch"] < 1e-6 for r in same)
    launches = _rows(by["speed"], "launch")
    assert launches and all(r["ms"] > 0 and r["bound_ms"] > 0 for r in launches)
    assert {r["stage"] for r in launches} == {"fwd", "bwd"}


def test_varlen_and_decode_rows_survive_a_failure_and_an_fla_not_warmed(clean):
    by = _steps(clean[1])
    rows = _rows(by["varlen"])
    ok = [r for r in rows if r["status"] == "ok"]
    assert len(rows) == 8 and len(ok) == 6 and all(r["ms"] > 0 for r in ok)
    assert {r["impl"] for r in rows if r["status"] == "error"} == {"stand-in that fails"}
    assert max(r["vs_ours"] for r in ok if r["mode"] == "fwd") < 1e-5
    assert by["varlen"]["result"]["stand_in_host_sync"] is None  # no host read
    # decode: fla's tuning skipped its calls (the dry run's fault): fla's rows are not
    # warmed, the failing stand-in's fail, ours are measured at every batch
    dec = {(r["impl"], r["batch"]): r for r in _rows(by["decode"])}
    for B in DRY.decode_batches:
        assert dec[("ours", B)]["status"] == "ok" and dec[("ours", B)]["ms"] > 0
        assert dec[("stand-in for fla fused_recurrent_gla", B)]["status"] == "not_warmed"
        assert "NotWarmed" in dec[("stand-in for fla fused_recurrent_gla", B)]["error"]
        assert dec[("stand-in that fails", B)]["status"] == "error"
    assert len(dec) == 3 * len(DRY.decode_batches)


def test_fla_is_tuned_once_and_its_winners_written(clean):
    _, result, _, path = clean
    tune = _steps(result)["tune"]
    r = tune["result"]
    assert tune["status"] == "ok" and r["tuned"] and r["fla_cold_s"] >= r["tune_s"] > 0
    with open(os.path.join(os.path.dirname(path), "fla-configs.json")) as f:
        winners = json.load(f)["winners"]
    # one tuned key per output size of fla's calls in speed and varlen (decode skipped)
    assert len(winners) == r["winners"] == 2
    assert {w["kernel"] for w in winners} == {"standin_tuned_copy"}
    assert all(w["config"]["kwargs"]["BLOCK"] in (64, 256) for w in winners)
    # fla's timed children loaded them and never tuned: their speed rows are measured
    speed = _steps(result)["speed"]
    assert speed["result"]["parts"]["fla"]["status"] == "ok"
    assert all(r["status"] == "ok" for r in _rows(speed) if "fla" in r["impl"])


def test_kernels_section_pairs_device_times_with_the_model(clean):
    _, result, md, _ = clean
    k = result["kernels"]
    assert k == {key: _steps(result)["kernels"][key] for key in ("status", "result", "rows")}
    rows = [r for r in k["rows"] if r["kind"] == "kernel"]
    fam = [r for r in rows if r["impl"] == "ours fused_recurrent (torch)"]
    assert [r["kernel"] for r in fam] == ["fused_recurrent_fwd_kernel",
                                         "fused_recurrent_fwd_kernel",
                                         "fused_recurrent_bwd_dkv_kernel",
                                         "fused_recurrent_bwd_combine_kernel"]
    assert all(r["us"] > 0 and r["model_dynamic"] > 0 and r["model_regs"] for r in fam)
    status = {r["impl"]: r["status"] for r in k["rows"] if r["kind"] == "profile"}
    assert status == {"ours chunk (torch)": "ok", "ours fused_recurrent (torch)": "ok",
                      "ours fused_chunk (torch)": "ok", "stand-in for fla chunk_gla": "absent"}
    for impl in ("ours chunk (torch)", "ours fused_recurrent (torch)"):
        mine = [r for r in rows if r["impl"] == impl]
        rho = k["result"]["rank_correlation"][impl]
        assert all(r.get("model_dynamic") for r in mine), impl
        assert rho == kernels.spearman([r["model_dynamic"] for r in mine],
                                       [r["us"] for r in mine])
    # chunk: the stages of the model's report, the forward's state pass among them
    chunk = [r for r in rows if r["impl"] == "ours chunk (torch)"]
    assert {(r["phase"], r["stage"]) for r in chunk} >= {
        ("fwd", "state"), ("fwd", "intra"), ("fwd", "output"), ("bwd", "dA"), ("bwd", "dv"),
        ("bwd", "dq/dk")}
    stages = k["result"]["stages"]["ours chunk (torch)"]
    assert stages["fwd/state"] == pytest.approx(sum(
        r["us"] for r in chunk if (r["phase"], r["stage"]) == ("fwd", "state")))
    assert "### Per-kernel device times" in md and "Spearman" in md
    assert "Stage by stage, device us: ours chunk (torch)" in md
    # each launch's warps and stages as launched, beside the model's where they differ
    # (the dry run's fp32 tiny call against the report's bf16 reference call)
    assert all(len(r["config"]) == 2 and len(r["model_config"]) == 2 for r in chunk + fam)
    differ = [r for r in chunk + fam if r["config"] != r["model_config"]]
    assert differ and "(model: " in md
    # the time model per kernel (the dry run's stand-in: the H200's), from the report's
    # sm_90 records, and its error summed over the kernels it has
    from parity.compiled import timemodel

    assert k["result"]["time_model"] == "H200 SXM"
    recs = {(r["phase"], r["kernel"]): r for r in next(
        rep for rep in json.load(open(kernels.READINESS))["readiness"]["gpu"]
        if rep["mode"] == "fused_recurrent")["launches"] if r["target"] == "sm_90"}
    for r in fam:
        want = timemodel.launch_time(recs[r["phase"], r["kernel"]], timemodel.HARDWARE["H200"])
        assert r["model_us"] == pytest.approx(want["total"] * 1e6)
    for impl in ("ours chunk (torch)", "ours fused_recurrent (torch)",
                 "ours fused_chunk (torch)"):
        mine = [r for r in rows if r["impl"] == impl]
        assert all(r.get("model_us") for r in mine), impl
        assert k["result"]["model_error"][impl] == pytest.approx(
            sum(r["model_us"] for r in mine) / sum(r["us"] for r in mine) - 1)
    assert "time model us (error)" in md and "summed over the kernels it has" in md


def test_time_model_by_device_name():
    assert kernels.modelled_gpu("NVIDIA H200").name == "H200 SXM"
    assert kernels.modelled_gpu("NVIDIA H100 80GB HBM3").name == "H100 SXM"
    assert kernels.modelled_gpu("NVIDIA A100-SXM4-80GB") is None


def test_rank_correlation_and_stages():
    assert kernels.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert kernels.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # ties averaged: ranks (0, 1.5, 1.5, 3) and (0, 2, 1, 3), Pearson 4.5 / sqrt(4.5 * 5)
    assert kernels.spearman([1, 2, 2, 3], [1, 3, 2, 4]) == pytest.approx(3 / 10 ** 0.5)
    assert kernels.spearman([1, 2], [2, 1]) is None
    names = {("fwd", "chunk_state_kernel"): "state", ("fwd", "chunk_fwd_kernel_h"): "state",
             ("fwd", "chunk_intra_kernel"): "intra",
             ("fwd", "chunk_gla_fwd_A_kernel_intra_sub_inter"): "intra",
             ("fwd", "chunk_output_kernel"): "output", ("fwd", "chunk_gla_fwd_kernel_o"): "output",
             ("bwd", "chunk_bwd_kernel_dh"): "state", ("bwd", "chunk_dA_kernel"): "dA",
             ("bwd", "chunk_gla_bwd_kernel_dA"): "dA", ("bwd", "chunk_gla_bwd_kernel_dv"): "dv",
             ("bwd", "chunk_dqk_kernel"): "dq/dk", ("bwd", "chunk_gla_bwd_kernel_inter"): "dq/dk",
             ("bwd", "chunk_gla_bwd_kernel_intra"): "dq/dk", ("bwd", "chunk_intra_kernel"): "intra",
             ("fwd", "chunk_local_cumsum_vector_kernel"): "gates",
             ("bwd", "void at::native::elementwise_kernel"): "other"}
    assert {k: kernels.stage(*k) for k in names} == names


class _FakeProfile:
    """What kernels._trace_kernels reads of a torch.profiler session: its Chrome trace,
    here written as torch 2.x writes CUDA kernel events (cat "kernel", args.grid)."""

    def export_chrome_trace(self, path):
        events = [{"ph": "X", "cat": "kernel", "name": "chunk_state_kernel", "dur": 12.5,
                   "args": {"grid": [256, 1, 1], "block": [128, 1, 1]}},
                  {"ph": "X", "cat": "cpu_op", "name": "aten::empty", "dur": 3.0},
                  {"ph": "X", "cat": "kernel", "name": "void at::native::fill", "dur": 1.0,
                   "args": {}}]
        with open(path, "w") as f:
            json.dump({"traceEvents": events}, f)


def test_profiler_trace_gives_kernel_name_grid_and_time():
    assert kernels._trace_kernels(_FakeProfile()) == [
        ("chunk_state_kernel", [256, 1, 1], 12.5), ("void at::native::fill", None, 1.0)]


def test_sweep_writes_a_device_table(clean):
    _, result, _, path = clean
    sw = result["sweep"]
    cands = [r for r in sw["rows"] if r["kind"] == "candidate"]
    assert cands and all(r["status"] == "ok" and r["us"] > 0 for r in cands)
    assert {r["family"] for r in cands} == {"fused_recurrent"}
    assert sum(r["default"] for r in cands) == len({r["site"] for r in cands})
    table = tuning.load(os.path.join(os.path.dirname(path), "tuning.json"))
    (device, rec), = table["devices"].items()
    assert device == sw["result"]["device"] and "never shipped" in device
    ranked = {k: e for k, e in rec["entries"].items() if k.startswith("auto/mode/")}
    assert len(rec["entries"]) == sw["result"]["entries"] + len(ranked)
    chosen = {(w["family"], w["site"]): w for w in sw["result"]["winners"]}
    for key, knobs in rec["entries"].items():
        if key in ranked:
            continue
        fam, site = key.split("/")[:2]
        w = chosen[(fam, site)]
        assert w["knobs"] == knobs and w["us"] < (1 - sw["result"]["margin"]) * w["default_us"]


def test_the_speed_rows_rank_the_families_for_mode_auto(clean, monkeypatch):
    """tuning.json's ranking entry (parity/gpu/ranking.py): at each length the family
    whose forward+backward the speed step timed fastest, the cost rule's (fused_recurrent
    at the dry run's T=16) kept unless another beats it by the sweep's margin; the device
    table it is in sends mode="auto" there."""
    from bridge import dispatch
    from parity.gpu import sweep

    _, result, md, path = clean
    rows = [r for r in _rows(_steps(result)["speed"]) if r["mode"] == "fwdbwd"
            and r["status"] == "ok" and r["impl"] == f"ours {r['family']} (torch)"]
    ms = {r["family"]: r["ms"] for r in rows}
    assert set(ms) == {"chunk", "fused_recurrent", "fused_chunk"} and {r["T"] for r in rows} == {
        DRY.Ts[0]}
    best = min(ms, key=ms.get)
    want = best if ms[best] < (1 - sweep.MARGIN) * ms["fused_recurrent"] else "fused_recurrent"
    table = tuning.load(os.path.join(os.path.dirname(path), "tuning.json"))
    entries = table["devices"][sweep.DRY_DEVICE]["entries"]
    key = f"auto/mode/float32/K{DRY.K}/V{DRY.V}/g=key"
    assert entries[key] == {"T": [DRY.Ts[0]], "fastest": [want]}
    assert result["ranking"]["entries"] == {key: entries[key]}
    times = "; ".join(f"{f} {ms[f]:.3f}" for f in sorted(ms))
    assert f"`{key}` in tuning.json: T={DRY.Ts[0]} {want} ({times} ms)." in md
    plan = report.report_plan((DRY.B, DRY.Ts[0], DRY.H, DRY.K, DRY.V), "fp32", "key")
    monkeypatch.setattr(tuning, "_shipped", lambda: table["devices"])  # as if merged
    with tuning.on_device(sweep.DRY_DEVICE):
        assert dispatch.kernel_mode("auto", plan) == want


def test_benchmarks_section_is_rendered_from_the_json(clean, tmp_path):
    proc, result, md, path = clean
    with open(BENCHMARKS) as f:
        before = f.read()
    head = lambda text: text.split("\n## GPU\n")[0]  # noqa: E731
    assert head(md) == head(before)
    section = md.split("\n## GPU\n", 1)[1].split("\n## ", 1)[0]  # to the next section
    assert section.strip() == render.markdown(result).strip()
    assert "Dry run on the CPU: stand-ins, not measurements" in section
    for s in DRY.stand_ins:
        assert s in section
    assert proc.stdout.rstrip().endswith(render.table(result).rstrip())
    # --render from the JSON alone writes the same section
    again = tmp_path / "B.md"
    shutil.copy(BENCHMARKS, again)
    subprocess.run([sys.executable, "-m", "parity.gpu", "--render", path, "--md", str(again)],
                   cwd=ROOT, check=True, capture_output=True)
    assert again.read_text() == md


def test_a_failed_or_hung_step_is_recorded_and_the_next_runs(tmp_path, clean):
    """Also: fla's winners from the clean run (--fla-configs): nothing is tuned."""
    configs = os.path.join(os.path.dirname(clean[3]), "fla-configs.json")
    _, result, md, _ = _kit(tmp_path, "--fla-configs", configs, *[
        a for s in ("machine=fail", "correctness=hang", "varlen=fail", "kernels=fail",
                    "sweep=fail") for a in ("--inject", s)])
    render.validate(result)
    by = _steps(result)
    assert by["machine"]["status"] == "error" and "injected" in by["machine"]["error"]
    # after a failure: runs, hangs, is killed at its 3 s cap
    assert by["correctness"]["status"] == "timed_out" and by["correctness"]["wall_s"] < 15
    assert "killed at its cap" in by["correctness"]["error"]
    assert by["varlen"]["status"] == "error"
    # the failed child's rows: each expected row recorded, with the child's failure
    varlen = _rows(by["varlen"])
    assert len(varlen) == 8 and all(r["status"] == "error" and "injected" in r["error"]
                                    for r in varlen)
    assert by["decode"]["status"] == "ok" and _rows(by["decode"])  # after all of them
    assert "| correctness | timed_out |" in md
    tune = by["tune"]["result"]
    assert tune["tuned"] is False and tune["source"] == configs and tune["winners"] == 2
    assert not [r for r in by["tune"]["rows"] if r["kind"] == "call"]  # nothing tuned
    assert all(r["status"] == "ok" for r in _rows(by["speed"]) if "fla" in r["impl"])
    assert f"winners loaded from {configs}" in md
    assert result["kernels"]["status"] == "error" and result["sweep"]["status"] == "error"


def test_ours_is_measured_without_fla(tmp_path):
    _, result, md, _ = _kit(tmp_path, *[a for s in ("fla=absent", "correctness=fail",
                                                    "kernels=fail", "sweep=fail")
                                        for a in ("--inject", s)])
    by = _steps(result)
    assert by["tune"]["result"]["skipped"].startswith("fla absent")
    for step in ("speed", "varlen", "decode"):
        rows = _rows(by[step])
        fla = [r for r in rows if "fla" in r["impl"]]
        ours = [r for r in rows if r["impl"].startswith("ours")]
        assert fla and all(r["status"] == "absent" and "fla absent" in r["error"] for r in fla)
        assert ours and all(r["status"] == "ok" for r in ours), step


def test_schema_and_section_placement():
    with pytest.raises(ValueError, match="steps"):
        render.validate({"schema": render.SCHEMA, "steps": [{"name": "machine"}]})
    step = {"name": "speed", "status": "ok", "cap_s": 1, "estimate_s": 1, "wall_s": 1,
            "result": {}, "rows": [{"kind": "row", "impl": "x"}]}
    with pytest.raises(ValueError, match="a row row with status None"):
        render.validate({"schema": render.SCHEMA, "steps": [step]})
    text = "# B\n\n## A\n\nold a\n\n## GPU\n\nold gpu\n\n## C\n\nc\n"
    want = "# B\n\n## A\n\nold a\n\n## GPU\n\nnew\n\n## C\n\nc\n"
    assert render.replace_section(text, "new") == want
    assert render.replace_section("# B\n", "new").endswith("\n\n## GPU\n\nnew\n")
    assert render.replace_section("x\n## GPU\n\nold\n", "new") == "x\n## GPU\n\nnew\n"


AUTOTUNE_SCRIPT = """
import bridge.kernels  # Triton's interpreter, before triton loads
import torch, triton, triton.language as tl
from triton.runtime import autotuner
from parity.gpu import fla

@triton.autotune(configs=[triton.Config({"B": b}) for b in (16, 32, 64, 128)], key=["n"],
                 do_bench=lambda fn, quantiles=None: (fn(), [1.0, 1.0, 1.0])[1])
@triton.jit
def k(x, n, B: tl.constexpr):
    o = tl.arange(0, B)
    tl.store(x + o, tl.load(x + o, mask=o < n) + 1, mask=o < n)

seen, bench = [], autotuner.Autotuner._bench
autotuner.Autotuner._bench = lambda self, *a, config, **kw: (
    seen.append(config.kwargs["B"]), bench(self, *a, config=config, **kw))[1]
fla.subset(1, 2)
x = torch.zeros(16)
k[(1,)](x, 16)
print("benchmarked", seen)
fla.no_autotune()
k[(1,)](x, 16)
print("tuned key runs")
try:
    k[(1,)](x, 9)
except fla.NotWarmed as e:
    print("refused:", e)
"""


def test_fla_autotuner_controls():
    """Compile workers benchmark only their share of the configs; a timed process refuses
    to autotune a key the warm-up did not reach, and runs one it did (a Triton autotuner
    under the interpreter, in a process of its own: the patches are process-wide)."""
    out = subprocess.run([sys.executable, "-c", AUTOTUNE_SCRIPT], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert "benchmarked [32, 128]" in out.stdout, out.stdout + out.stderr[-2000:]
    assert "tuned key runs" in out.stdout
    assert "refused: fla's autotuner for k was not warmed" in out.stdout


FLA_WINNERS = """
import json
import bridge.kernels  # Triton's interpreter, before triton loads
from parity.gpu import fla
from parity.gpu.plan import FULL
fns, why = fla.ops(FULL)
found = fla.autotuners(fla.FLA_MODULES)
at = found[("fla.ops.gla.chunk", "chunk_gla_fwd_kernel_o")]
config = at.configs[-1]
record = {"module": "fla.ops.gla.chunk", "kernel": "chunk_gla_fwd_kernel_o",
          "key": [128, 128, 64, "torch.bfloat16"], "config": fla._config_dict(config)}
loaded = fla.load_winners([record, dict(record, kernel="no_such_kernel")], fla.FLA_MODULES)
back = [w for w in fla.winners(fla.FLA_MODULES) if w["kernel"] == "chunk_gla_fwd_kernel_o"]
print(json.dumps({"n": len(found), "loaded": loaded, "back": back, "record": record,
                  "h": ("fla.ops.common.chunk_h", "chunk_fwd_kernel_h") in found,
                  "same": at.cache[(128, 128, 64, "torch.bfloat16")].all_kwargs()
                  == config.all_kwargs()}))
"""


def test_fla_winners_round_trip_through_fla_core_s_own_autotuners():
    """fla's autotuners are found by module (fla-core 0.6.0 imports on the CPU); a
    winner written as JSON loads back into the autotuner it names and reads back the same."""
    if importlib.util.find_spec("fla") is None:
        pytest.skip("fla-core (the bench and test extras) not installed")
    out = subprocess.run([sys.executable, "-c", FLA_WINNERS], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["n"] > 50 and got["h"] and got["loaded"] == 1 and got["same"]
    assert got["back"] == [got["record"]]


def test_property_log_gives_the_shrunk_case(tmp_path):
    """The correctness step's record of the property run (parity/gpu/correctness.py): the
    last failure a backend logged is its shrunk case; one cut off has passed None."""
    from parity.gpu.correctness import read_properties

    log = tmp_path / "properties.jsonl"
    rows = [dict(label="a", problem="(Case(T=9), ...)", error="AssertionError: big"),
            dict(label="b", checked=40, seconds=30.2, passed=True),
            dict(label="a", problem="(Case(T=1), ...)", error="AssertionError: small"),
            dict(label="a", checked=3, seconds=31.0, passed=False),
            dict(label="c", problem="(Case(T=2), ...)", error="E")]
    log.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"label": "c", "chec')
    got = read_properties(str(log), 7, 30)
    assert got["seed"] == 7 and got["seconds_each"] == 30
    a, b, c = (got["backends"][n] for n in "abc")
    assert a["passed"] is False and a["shrunk"] == "(Case(T=1), ...)" and a["checked"] == 3
    assert b == dict(passed=True, shrunk=None, checked=40, seconds=30.2)
    assert c["passed"] is None and c["shrunk"] == "(Case(T=2), ...)"
    assert read_properties(str(tmp_path / "none"), 1, 2)["backends"] == {}


def test_sweep_leaves_out_candidates_that_change_nothing():
    """The full plan's sweep (planning only, no GPU): every candidate of a site gives other
    launch lists than the site's earlier ones (parity.gpu.sweep.by_site), the defaults
    first; fused_chunk's with_dk stays only where the dv walk has all of V (SV 128 at the
    reference V = 128), and its forward's 48 configs (warps x BKI x BV x stages x BT) all
    stay beside its defaults."""
    from parity.gpu import sweep
    from parity.gpu.plan import FULL

    sites = {(gates, key): (p, mode, cands) for gates, mode, p, key, cands in
             sweep.by_site(FULL)}
    for (gates, (fam, site)), (p, mode, cands) in sites.items():
        lists = [repr(sweep._lists(p, mode, {(fam, site): k})) for _, _, k in cands]
        assert len(set(lists)) == len(lists), (gates, site)
        assert cands[0][2] == tuning.sites(p, mode)[(fam, site)], (gates, site)
    dv = [k for _, _, k in sites["key", ("fused_chunk", "bwd_dv")][2]]
    assert {k["SV"] for k in dv if k["with_dk"]} == {128}
    # the defaults (unpipelined off sm_90), then 2 warps x 3 V blocks x 2 chunk lengths,
    # + with_dk at SV 128, each at 2 and 3 stages
    assert len(dv) == 1 + 32
    assert len(sites["key", ("fused_chunk", "fused_chunk_fwd_kernel")][2]) == 1 + 48
