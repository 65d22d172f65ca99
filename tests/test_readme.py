"""The Python examples of README.md and bridge/SPEC.md run as written, and the README's
test command is what CI runs."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parents[1]
DOCS = ("README.md", "bridge/SPEC.md")
README = (ROOT / "README.md").read_text()


def python_blocks(text):
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


ALL_BLOCKS = [(doc, i, b) for doc in DOCS
              for i, b in enumerate(python_blocks((ROOT / doc).read_text()))]
# scripts for several processes (their first line names the torchrun command) run below;
# "# many devices" blocks need 8 host devices: tests/test_jax_multidevice.py runs the
# README's (tests/multidevice_cases.py reads them there)
TORCHRUN = [x for x in ALL_BLOCKS if x[2].startswith("# ") and "torchrun" in x[2].splitlines()[0]]
MANY_DEVICES = [x for x in ALL_BLOCKS if x[2].startswith("# many devices")]
BLOCKS = [x for x in ALL_BLOCKS if x not in TORCHRUN and x not in MANY_DEVICES]


def _name(x):
    return f"{x[0]} python block {x[1]}"


def test_the_examples_are_found():
    assert len(python_blocks(README)) >= 3 and BLOCKS and TORCHRUN
    # tests/multidevice_cases.py runs only the README's many-device blocks
    assert all(doc == "README.md" for doc, _, _ in MANY_DEVICES)


@pytest.mark.parametrize("block", BLOCKS, ids=_name)
def test_python_example_runs(block):
    code = block[2]
    if "torch" in code:
        pytest.importorskip("torch")
    if "jax" in code:
        pytest.importorskip("jax")
    exec(compile(code, _name(block), "exec"), {})


@pytest.mark.parametrize("step", ["test", "matrix"])
def test_ci_runs_the_readme_commands(step):
    """.ci/run runs each README command marked for CI, as the README prints it (its own
    extraction, run here, gives the README's code block)."""
    ci = (ROOT / ".ci" / "run").read_text()
    after = README.split(f"<!-- ci:{step} -->", 1)[1]
    command = re.search(r"```bash\n(.*?)\n```", after, flags=re.S).group(1)
    assert {"test": "pytest", "matrix": "parity.triton_matrix"}[step] in command
    block = re.search(r"^block\(\) \{.*?^\}", ci, flags=re.S | re.M).group(0)
    got = subprocess.run(["bash", "-c", f"{block}\nblock {step}"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.strip()
    assert got == command
    assert re.search(rf"^for step in .*\b{step}\b.*; do$", ci, flags=re.M)


@pytest.mark.parametrize("block", TORCHRUN, ids=_name)
def test_torchrun_example_runs(block, tmp_path):
    """The block runs as its first line says: torchrun with 2 processes (gloo, CPU)."""
    pytest.importorskip("torch")
    code = block[2]
    first = code.splitlines()[0]
    nproc = int(re.search(r"--nproc-per-node (\d+)", first).group(1))
    script = tmp_path / re.search(r"(\S+\.py)$", first).group(1)
    script.write_text(code)
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          f"--nproc-per-node={nproc}", str(script)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    log = run.stdout[-3000:] + run.stderr[-5000:]
    # every rank got to its last line; a failing exit code is accepted only as the abort
    # gloo sometimes gives at interpreter exit after the work is done (bridge/SPEC.md,
    # "Context parallelism over torch.distributed")
    assert all(f"rank {r}: done" in run.stdout for r in range(nproc)), log
    assert run.returncode == 0 or "terminate called without an active exception" in log, log
