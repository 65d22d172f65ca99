"""The benchmark tool (parity.bench): end to end at --quick, the pre-timing check, the
FLOP count, failing / over-budget anchors in the table, the memory probe."""

import importlib.util
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from parity.bench import anchors, flops, report, runner, timing, verify  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _native(q, k, v, g):
    import torch_side

    return torch_side.recurrent_gla(q, k, v, g, platform="torch")[0]


def _torch_impl(name, op):
    return anchors.Impl(name, "torch", anchors._torch_build(op))


# ------------------------------------------------------------------ end to end

def test_quick_end_to_end(tmp_path):
    """--quick writes the markdown and JSON; every installed implementation passed the
    oracle check before timing; anchors that are not installed are reported as such."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}  # forces the re-exec
    proc = subprocess.run([sys.executable, "-m", "parity.bench", "--quick", "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    md = (tmp_path / "BENCHMARKS.md").read_text()
    data = json.loads((tmp_path / "results.json").read_text())
    assert "| T | torch-native |" in md and "## GPU" in md and "## Targets" in md
    # the chunk-matmul ceiling: both frameworks measured for every benchmarked shape
    ceil = data["machine"]["chunk_matmul"]
    assert [tuple(r["shape"]) for r in ceil] == [(1, 2, 16, 16)]
    assert all(r["torch"] > 0 and r["xla"] > 0 for r in ceil)
    assert "| (1, 2, 16, 16), 96 | " in md
    if importlib.util.find_spec("matplotlib") is not None:  # the bench extra's plotting
        assert list(tmp_path.glob("*.png"))
    else:
        assert "no plot: matplotlib is not installed" in proc.stderr
    names = [i.name for i in anchors.cpu_impls()]
    by_impl = {r["impl"]: r for r in data["records"] if r["mode"] == "fwd"}
    assert set(by_impl) == set(names)  # nothing dropped
    for impl in anchors.cpu_impls():
        fwd_check = data["checks"][impl.name]["fwd"]
        if impl.missing():
            assert fwd_check.startswith("not installed")
            assert by_impl[impl.name]["status"] == "missing"
            assert "not installed" in md
        else:  # installed: verified against the oracle, then timed
            assert fwd_check is None, (impl.name, fwd_check)
            assert by_impl[impl.name]["median_s"] > 0
    # Our own paths are checked in both modes and timed with a peak-memory figure.
    for name in ("torch-native", "jax-xla"):
        assert data["checks"][name] == {"fwd": None, "fwdbwd": None}
        r = next(r for r in data["records"] if r["impl"] == name and r["mode"] == "fwdbwd")
        assert r["status"] == "ok" and r["peak_bytes"] is not None
    if importlib.util.find_spec("ejkernel") is not None:  # its default-path backward fails
        assert data["checks"]["ejkernel XLA"]["fwdbwd"].startswith("error")
    # The stored JSON alone regenerates the same markdown (no hand-edited numbers).
    from parity.bench.__main__ import main

    main(["--render", str(tmp_path / "results.json"), "--out", str(tmp_path),
          "--md", str(tmp_path / "again.md")])
    assert (tmp_path / "again.md").read_text() == md
    # what no bench command measures survives a rewrite: parity.train's section, the tuning
    # history, the time model's section (in its place, after the TPU readiness)
    kept = tmp_path / "kept.md"
    kept.write_text("# old\n\n## Time model and fused_chunk (compiled, not run)\n\nmodel\n\n"
                    "## Training parity\n\nsteps\n\n"
                    "## Tuning history of the CPU paths\n\nknobs\n")
    main(["--render", str(tmp_path / "results.json"), "--out", str(tmp_path), "--md", str(kept)])
    text = kept.read_text()
    assert "| T | torch-native |" in text and "# old" not in text
    assert text.endswith("## Training parity\n\nsteps\n\n## Tuning history of the CPU paths\n\n"
                         "knobs\n")
    assert ("## TPU readiness" in text.split("## Time model and fused_chunk (compiled, not "
                                             "run)\n\nmodel\n\n## torch.compile time")[0])
    if importlib.util.find_spec("matplotlib") is None:
        # without matplotlib a render keeps the plots already there (none in this folder)
        assert "![" not in text
        (tmp_path / "time_vs_T_B1_H2_K16_V16.png").write_bytes(b"")
        main(["--render", str(tmp_path / "results.json"), "--out", str(tmp_path), "--md",
              str(kept)])
        assert "![time_vs_T_B1_H2_K16_V16.png](time_vs_T_B1_H2_K16_V16.png)" in kept.read_text()


# ------------------------------------------------------------------ the check

def test_check_passes_a_correct_implementation():
    assert verify.check(_torch_impl("native", _native)) == {"fwd": None, "fwdbwd": None}


def test_check_catches_a_wrong_implementation():
    """A 1% error in the output, and a forward that is right but a g gradient that is
    lost (g detached, dg = 0), are both caught."""
    wrong_fwd = _torch_impl("scaled", lambda q, k, v, g: 1.01 * _native(q, k, v, g))
    got = verify.check(wrong_fwd)
    assert got["fwd"].startswith("wrong result") and got["fwdbwd"].startswith("wrong result")
    wrong_grad = _torch_impl("detached", lambda q, k, v, g: _native(q, k, v, g.detach() + 0 * g))
    got = verify.check(wrong_grad)
    assert got["fwd"] is None
    assert got["fwdbwd"].startswith("wrong result") and "dg" in got["fwdbwd"]


def test_fla_naive_loads_without_triton_and_matches_oracle():
    """With the bench extra: fla's reference loads by file path and matches the
    oracle. Without it (CI): the anchor reports that it is not installed."""
    fla = next(i for i in anchors.cpu_impls() if i.name == "fla naive")
    if importlib.util.find_spec("fla") is None:
        with pytest.raises(ImportError, match="fla-core"):
            anchors.load_fla_naive()
        assert fla.missing() == "not installed (fla)"  # what the table reports
        return
    assert verify.check(fla) == {"fwd": None, "fwdbwd": None}


def test_lax_scan_anchor_matches_oracle():
    pytest.importorskip("jax")
    scan = next(i for i in anchors.cpu_impls() if i.name == "lax.scan")
    assert verify.check(scan) == {"fwd": None, "fwdbwd": None}


# ------------------------------------------------------------------ FLOPs

def _counted_chunk_forward(B, T, H, K, V, chunk):
    """FLOPs torch's counter sees in the four matmuls of a chunked forward."""
    from torch.utils.flop_counter import FlopCounterMode

    q, k = torch.randn(B, H, T, K), torch.randn(B, H, T, K)
    v = torch.randn(B, H, T, V)
    S = torch.zeros(B, H, K, V)
    with FlopCounterMode(display=False) as counter:
        for s in range(0, T, chunk):
            qc, kc, vc = q[:, :, s:s + chunk], k[:, :, s:s + chunk], v[:, :, s:s + chunk]
            A = qc @ kc.transpose(-1, -2)
            _ = A @ vc + qc @ S
            S = S + kc.transpose(-1, -2) @ vc
    return counter.get_total_flops()


def test_flop_formula_closed_form():
    # (1,128,1,64,64): 2 chunks x (2*64^2*(64+64) + 4*64*64*64) = 2 x 2,097,152
    assert flops.forward_flops(1, 128, 1, 64, 64) == 4_194_304
    assert flops.flops(1, 128, 1, 64, 64, "fwdbwd") == 3 * 4_194_304
    # A ragged tail and K != V, against torch's own FLOP counter.
    for size in [(2, 80, 3, 16, 8), (1, 64, 1, 32, 32), (1, 5, 2, 4, 6)]:
        assert flops.forward_flops(*size) == _counted_chunk_forward(*size, flops.CHUNK), size
    with pytest.raises(ValueError, match="mode"):
        flops.flops(1, 64, 1, 8, 8, "bwd")
    with pytest.raises(ValueError, match="T=0"):
        flops.forward_flops(1, 0, 1, 8, 8)


# ------------------------------------------------------------------ failures and budget

def _tiny_sweep(impls, budget_s=10.0, Ts=(32, 64), checks=None):
    settings = runner.Settings(budget_s=budget_s, rep_budget_s=0.05, min_repeats=1, repeats=2,
                               log=lambda msg: None)
    checks = checks or runner.check_all(impls, settings.log)
    records = runner.sweep(impls, [(1, 1, 8, 8)], list(Ts), settings, checks)
    machine = {"matmul_gflops": 100.0, "budget_s": budget_s}
    md = report.markdown(records, impls, {"torch": "native"}, machine, checks)
    return records, md


def test_failing_anchor_is_reported_with_its_reason():
    def broken_build(a):
        raise RuntimeError("anchor exploded: out of memory (simulated)")

    def fails_at_64(q, k, v, g):
        if q.shape[-1] == 8 and q.shape[1] >= 64:  # not at the check size (K=16)
            raise MemoryError("simulated OOM at T=64")
        return _native(q, k, v, g)

    impls = [_torch_impl("native", _native),
             anchors.Impl("broken", "torch", broken_build),
             _torch_impl("late failure", fails_at_64),
             anchors.Impl("absent", "torch", broken_build, requires=("no_such_module_xyz",))]
    records, md = _tiny_sweep(impls)
    idx = {(r["impl"], r["mode"], r["T"]): r for r in records}
    assert idx["native", "fwdbwd", 64]["status"] == "ok"
    for T in (32, 64):
        assert idx["broken", "fwd", T]["status"] == "error"
        assert idx["absent", "fwd", T]["status"] == "missing"
    assert idx["late failure", "fwd", 32]["status"] == "ok"
    assert idx["late failure", "fwd", 64]["status"] == "error"
    assert "anchor exploded: out of memory (simulated)" in md
    assert "MemoryError: simulated OOM at T=64" in md
    assert "not installed (no_such_module_xyz)" in md
    assert "native vs broken" in md  # the ratio column stays, with no number


def test_over_budget_stops_growing_T():
    # Cheap stand-ins (the oracle check is bypassed: only the budget logic is under
    # test), so that a busy machine cannot push the fast one over the budget too.
    def fast(q, k, v, g):
        return v + 0 * (q + k + g).sum(-1, keepdim=True)  # uses every input: all have grads

    def slow(q, k, v, g):
        time.sleep(0.25)
        return fast(q, k, v, g)

    impls = [_torch_impl("native", fast), _torch_impl("slow", slow),
             anchors.Impl("slow ours", "torch", anchors._torch_build(slow), budgeted=False)]
    ok = {"fwd": None, "fwdbwd": None}
    records, md = _tiny_sweep(impls, budget_s=0.15, Ts=(32, 64),
                              checks={"native": ok, "slow": ok, "slow ours": ok})
    idx = {(r["impl"], r["mode"], r["T"]): r for r in records}
    for mode in ("fwd", "fwdbwd"):
        first = idx["slow", mode, 32]
        assert first["median_s"] >= 0.25 and "budget" in first["reason"]  # that call is kept
        later = idx["slow", mode, 64]
        assert later["status"] == "over budget" and later["median_s"] is None
        assert idx["native", mode, 64]["status"] == "ok"  # the others keep growing T
        assert idx["slow ours", mode, 64]["median_s"] >= 0.25  # our own paths are never cut
    assert "over budget (at T=32" in md


# ------------------------------------------------------------------ memory, arguments

def test_peak_memory_sees_a_known_allocation():
    n = 64 * 2 ** 20
    try:
        timing.peak_memory_bytes(lambda: None)
    except OSError:
        pytest.skip("/proc/self/clear_refs not writable here")
    peaks = [timing.peak_memory_bytes(lambda: np.ones(n // 8)) for _ in range(2)]
    peaks.append(timing.peak_memory_bytes(lambda: np.ones(n // 8), tries=3))
    assert all(0.95 * n <= p <= 1.5 * n for p in peaks), peaks
    assert timing.peak_memory_bytes(lambda: np.ones(1000)) < 0.1 * n


def test_tensor_peak_counts_what_is_alive_at_once():
    """Two n-float tensors alive together, then one freed: the peak is exactly 2 of them,
    however often it runs; nothing allocated reads 0."""
    import torch

    n = 1 << 20

    def two_then_one():
        a = torch.ones(n)
        b = a + a
        del a
        return b * b  # a third while b is alive: still two at once

    assert [timing.peak_tensor_bytes(two_then_one) for _ in range(3)] == [8 * n] * 3
    assert timing.peak_tensor_bytes(lambda: None) == 0


def test_bad_arguments_are_rejected():
    from parity.bench.__main__ import parse

    with pytest.raises(SystemExit):
        parse(["--shapes", "1,2,3"])
    with pytest.raises(SystemExit):
        parse(["--T", "0"])
    assert parse(["--shapes", "1,2,16,16", "--T", "64"]).shapes == [(1, 2, 16, 16)]


def test_targets_use_a_lower_bound_for_an_anchor_over_budget():
    """fla over budget at T=4096 after 8 s at T=2048, ours 0.1 s at 4096: >= 80x, met."""
    def rec(impl, T, median, status="ok", peak=None):
        return {"shape": [1, 1, 8, 8], "mode": "fwdbwd", "T": T, "impl": impl, "status": status,
                "reason": "" if status == "ok" else "over budget (at T=2048)",
                "median_s": median, "peak_bytes": peak,
                "flops": flops.flops(1, T, 1, 8, 8, "fwdbwd")}

    records = [rec("fla naive", 2048, 8.0), rec("fla naive", 4096, None, "over budget"),
               rec("torch-native", 2048, 0.05), rec("torch-native", 4096, 0.1),
               rec("jax-xla", 4096, 0.2, peak=100), rec("lax.scan", 4096, 1.0),
               rec("ejkernel XLA packed", 4096, 4.0, peak=1000)]
    lines = "\n".join(report.targets(records, {"matmul_gflops": 100.0}))
    assert ">= 80x (lower bound: anchor over budget, its T=2048 time used) (met)" in lines
    assert "| jax-xla >= 10x faster than lax.scan | 5.00x (NOT met) |" in lines
    assert "20x (met)" in lines  # ejkernel packed 4.0 / 0.2
    assert "| jax-xla peak memory >= 4x below ejkernel XLA packed | 10x (met) |" in lines


def test_gpu_section_kept_on_a_machine_without_one(tmp_path):
    """A CPU run keeps the GPU section an earlier GPU run stored; `--gpu` without a
    CUDA device stops with the reason instead of writing an empty section."""
    from parity.bench import gpu
    from parity.bench.__main__ import gpu_markdown, main, parse

    if gpu.unavailable() is None:
        pytest.skip("this machine has a CUDA device: the section would be measured")
    args = parse(["--quick", "--out", str(tmp_path)])
    assert gpu_markdown(args, print).startswith("not measured: no GPU on this machine")
    (tmp_path / "results.json").write_text(json.dumps({"gpu": "Measured on an H100: 4.17 ms"}))
    assert gpu_markdown(args, print) == "Measured on an H100: 4.17 ms"
    with pytest.raises(SystemExit, match="no CUDA device"):
        main(["--gpu", "--out", str(tmp_path)])


def test_decode_rows_agree_and_render():
    """The decode benchmark's two layers (ours, and the plain per-step reference with the
    same weights) give the same outputs and states before anything is timed (torch, tiny)."""
    from parity.bench import decode

    rows = decode.measure("torch", quick=True)
    assert [r["batch"] for r in rows] == list(decode.QUICK["batches"])
    assert all(r["max_abs_diff"] < 1e-5 and r["ours_s"] > 0 and r["ref_s"] > 0 for r in rows)
    text = decode.section(rows + [{"framework": "jax", "error": "exit 1"}])
    assert text.count("| torch |") == len(rows) and "jax: not measured (exit 1)" in text


def test_forward_targets_rows():
    """Issue 19's forward rows: the lowest ratio over T >= 1024, memory against output +
    final state and against the run before."""
    from parity.bench import report

    shape = (1, 1, 2, 2)
    rec = lambda impl, mode, T, s, peak=None: {"shape": list(shape), "mode": mode, "T": T,
                                               "impl": impl, "median_s": s, "status": "ok",
                                               "reason": "", "peak_bytes": peak, "flops": 1}
    records = [rec("jax-xla", "fwd", 512, 1.0), rec("lax.scan", "fwd", 512, 0.1),
               rec("jax-xla", "fwd", 1024, 1.0), rec("lax.scan", "fwd", 1024, 2.0),
               rec("jax-xla", "fwd", 4096, 1.0, peak=3 * 4 * (4096 * 2 + 4)),
               rec("lax.scan", "fwd", 4096, 1.2)]
    text = "\n".join(report.targets(records, {}))
    assert "lowest 1.20x (T=4096; T >= 1024: 2.00x, 1.20x) (NOT met)" in text
    assert "jax-xla forward peak memory (no gradients) <= 3x output + final state, T=4096 | " \
           "0.09 MiB = 3.00x (met)" in text


def test_profile_runs_in_both_frameworks():
    """The per-stage profile's children run on the current code (a full bench run is
    the only other caller) and the section renders every stage they timed."""
    from parity.bench import profile

    tables = profile.run(log=lambda *_: None, quick=True)
    assert [t["framework"] for t in tables] == ["torch", "jax"]
    text = profile.section(tables)
    for t in tables:
        assert t["rows"] and all(x > 0 for _, x in t["rows"]), t
        assert all(name in text for name, _ in t["rows"])
