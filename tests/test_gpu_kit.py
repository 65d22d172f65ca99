"""The GPU kit (`python -m parity.gpu`) in its dry run: the same orchestration on the
CPU at tiny shapes (Triton's interpreter; stand-ins for CUDA and fla, named as such).

Checked: every step runs in order under its cap and records its result; the JSON
follows the schema; the figures agree where they must (our kernels against fla's
stand-ins, an independent algorithm); a step made to fail, or to hang past its cap, is
recorded and the next step still runs; BENCHMARKS.md's GPU section is rendered from the
JSON alone, the rest of the file untouched. Two kit runs, ~20-40 s each here."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from parity.gpu import render
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
    tests = _rows(by["correctness"], "test")  # no CUDA: tests/test_cuda.py skips itself
    assert tests and all(t["outcome"] == "skipped" for t in tests)
    assert by["correctness"]["result"]["counts"]["skipped"] == len(tests)


def test_speed_times_every_implementation_and_they_agree(clean):
    by = _steps(clean[1])
    rows = _rows(by["speed"])
    timed = {(r["impl"], r["mode"]) for r in rows if r["ms"] and r["ms"] > 0 and not r["error"]}
    impls = ["ours chunk (torch)", "ours fused_recurrent (torch)", "stand-in for fla chunk_gla",
             "stand-in for fla fused_recurrent_gla", "ours fused_recurrent (jax)",
             "ours fused_recurrent (torch, synced)"]
    assert timed == {(i, m) for i in impls for m in ("fwd", "fwdbwd")}
    # ours chunked against each other implementation (fla's stand-ins: independent code)
    agree = [r["vs_ours_chunk"] for r in rows if r.get("vs_ours_chunk") is not None]
    assert len(agree) == 8 and max(agree) < 1e-5, agree
    same = _rows(by["speed"], "agree")  # one kernel, two launchers
    assert same and all(r["jax_vs_torch"] < 1e-6 for r in same)
    launches = _rows(by["speed"], "launch")
    assert launches and all(r["ms"] > 0 and r["bound_ms"] > 0 for r in launches)
    assert {r["stage"] for r in launches} == {"fwd", "bwd"}
    assert "compile-ahead workers" in by["speed"]["result"]["ahead"]


def test_varlen_and_decode(clean):
    by = _steps(clean[1])
    rows = _rows(by["varlen"])
    assert len(rows) == 6 and all(r["ms"] > 0 and not r["error"] for r in rows)
    assert max(r["vs_ours"] for r in rows if r["mode"] == "fwd") < 1e-5
    assert by["varlen"]["result"]["stand_in_host_sync"] is None  # no host read
    dec = _rows(by["decode"])
    assert [r["batch"] for r in dec] == list(DRY.decode_batches)
    assert all(r["ours_ms"] > 0 and r["fla_ms"] > 0 and r["vs_fla"] < 1e-5 for r in dec)


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


def test_a_failed_or_hung_step_is_recorded_and_the_next_runs(tmp_path):
    _, result, md, _ = _kit(tmp_path, *[a for s in ("machine=fail", "correctness=hang",
                                                    "speed=fail", "varlen=fail")
                                        for a in ("--inject", s)])
    render.validate(result)
    by = _steps(result)
    assert by["machine"]["status"] == "error" and "injected" in by["machine"]["error"]
    # after a failure: runs, hangs, is killed at its 3 s cap
    assert by["correctness"]["status"] == "timed_out" and by["correctness"]["wall_s"] < 15
    assert "killed at its cap" in by["correctness"]["error"]
    assert by["speed"]["status"] == "error" and by["varlen"]["status"] == "error"
    assert by["decode"]["status"] == "ok" and _rows(by["decode"])  # after all of them
    assert "| correctness | timed_out |" in md


def test_schema_and_section_placement():
    with pytest.raises(ValueError, match="steps"):
        render.validate({"schema": render.SCHEMA, "steps": [{"name": "machine"}]})
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
