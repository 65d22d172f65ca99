"""Every chunk kernel variant builds ahead of time (no GPU). A file of its own so
that pytest-xdist runs this long build beside tests/test_aot.py's reports."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def test_chunk_variants_compile_ahead_of_time(tmp_path):
    """Every chunk kernel variant the launchers can request (each flag, dtype and
    block size of bridge.aot's variant list) builds for sm_90 with a real
    launch's alignment hints, within shared memory and 255 registers, and spills
    at most 256 bytes (measured: up to 240 B in fp32 FMA products and in the
    every-flag K = V = 64 variants; the fp32 tiles of 64 once spilled 36 KB).
    The bf16/fp16 configurations are held to no spills, on sm_80 and sm_90, by
    tests/test_aot.py."""
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path / "cache"))
    out = tmp_path / "aot.json"
    res = subprocess.run([sys.executable, "-m", "bridge.aot", "--arch", "90", "--family", "chunk",
                          "--hints", "--json", str(out)], env=env, capture_output=True, text=True,
                         timeout=1500)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    rows = json.loads(out.read_text())
    assert len(rows) >= 100 and all(r["ok"] for r in rows)
    assert all(r["regs"] and r["regs"] <= 255 for r in rows)
    assert {r["kernel"] for r in rows} == {
        "chunk_gate_kernel", "chunk_state_kernel", "chunk_intra_kernel", "chunk_output_kernel",
        "chunk_dA_kernel",
        "chunk_dv_kernel", "chunk_dqk_kernel", "chunk_dgamma_kernel"}
    spilled = sorted((r["spill_bytes"], r["variant"], r["kernel"]) for r in rows
                     if r["spill_bytes"])
    assert not spilled or spilled[-1][0] <= 256, spilled
