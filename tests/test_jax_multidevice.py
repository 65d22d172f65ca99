"""JAX on 8 host devices (issue 16): shard_map with check_vma=True on every platform,
batch/head sharding under jax.jit, context parallelism (`context_axis=`).

The checks run in ONE subprocess (tests/multidevice_cases.py) with
XLA_FLAGS=--xla_force_host_platform_device_count=8, so the rest of the suite stays
on one device; each test here asserts on one group of its results. Every check
compares with the float64 oracle or the same call on one device, or bounds the
compiled HLO's collectives. GLA_MULTIDEVICE=full runs the whole matrix.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def results():
    # the test session's XLA flags (tests/conftest.py) with 8 host devices
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    env = dict(os.environ, XLA_FLAGS=flags.strip(),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "multidevice_cases.py")],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    rows = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert run.returncode == 0, run.stderr[-3000:]
    return rows


def _check(rows, prefix):
    mine = [r for r in rows if r["name"].startswith(prefix)]
    assert mine, f"no check named {prefix!r} ran"
    bad = [r for r in mine if not r["err"] <= r["tol"]]
    assert not bad, "\n".join(json.dumps(r) for r in bad)
    return mine


def test_no_check_raised(results):
    bad = [r["name"] for r in results if " raised " in r["name"]]
    assert not bad, "\n".join(bad)


def test_shard_map_check_vma_every_platform(results):
    rows = _check(results, "shard_map ")
    assert {r["name"].split()[1] for r in rows} == {"xla", "pallas", "triton"}


def test_batch_head_sharding_under_jit(results):
    rows = _check(results, "jit ")
    assert any("forward collectives" in r["name"] for r in rows)


def test_context_parallel(results):
    rows = _check(results, "context ")
    names = " ".join(r["name"] for r in rows)
    for needle in ("xla", "pallas", "triton", "P=2", "P=4", "P=8", "dinitial_state",
                   "dg_gamma", "dgv", "dgk"):
        assert needle in names, needle


def test_context_parallel_collectives_are_state_sized(results):
    rows = _check(results, "context hlo ")
    assert any("T/P=256" in r["name"] for r in rows)


def test_readme_many_devices_example(results):
    _check(results, "readme many devices")


def test_context_axis_errors_name_the_argument():
    import jax.numpy as jnp

    import jax_side

    x = jnp.ones((1, 8, 1, 4))
    with pytest.raises(ValueError, match="^context_axis: 'cp' is not an axis"):
        jax_side.recurrent(x, x, x, context_axis="cp")  # outside shard_map
    with pytest.raises(TypeError, match="^context_axis: expected a mesh axis name"):
        jax_side.recurrent(x, x, x, context_axis=3)


def test_collective_bytes_reads_hlo_results():
    from parity.bench.multidevice import collective_bytes

    hlo = """
  %ag = f32[4,2,80]{2,1,0} all-gather(f32[1,2,80]{2,1,0} %p), channel_id=1, dimensions={0}
  %ar = (f32[16]{0}, bf16[2,3]{1,0}) all-reduce(%a, %b), channel_id=2, to_apply=%add
  %ars = f32[8]{0} all-reduce-start(f32[8]{0} %c), channel_id=3, to_apply=%add
  %add = f32[4,2,80]{2,1,0} add(%ag, %ag)
"""
    assert collective_bytes(hlo) == [("all-gather", 4 * 2 * 80 * 4),
                                     ("all-reduce", 16 * 4 + 6 * 2), ("all-reduce", 32)]
