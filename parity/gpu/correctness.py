"""Step 2: correctness on the device: `tests/test_cuda.py` under pytest, in this child
process (its xdist workers are its own children). The file holds the compiled kernels of
both families from torch and JAX against the float64 oracle, the (8,4096,16,128,128)
chunk-vs-fused test, torch.compile(fullgraph=True) of both layers through the triton_op
path, JAX arrays committed to the CPU reaching the compiled kernels, and varlen without a
host sync. One row per test, from pytest's JUnit XML."""

import os
import shlex
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = "tests/test_cuda.py"


def run(emit, deadline, *, plan, xml_path):
    import pytest

    args = [TESTS, "-q", "-p", "no:cacheprovider", "--junitxml", xml_path, *plan.pytest_args]
    print("correctness: pytest", " ".join(args), flush=True)
    os.chdir(ROOT)
    code = int(pytest.main(args))
    tests = parse(xml_path)
    for t in tests:
        emit("test", **t)
    counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "skipped")}
    return {"command": "python -m pytest " + shlex.join([TESTS, *plan.pytest_args]),
            "exit_code": code, "counts": counts}


def parse(xml_path):
    """[{name, outcome (passed/failed/skipped), seconds, message}] of a JUnit XML file;
    a module skipped whole is one row."""
    try:
        root = ET.parse(xml_path).getroot()
    except (OSError, ET.ParseError):
        return []
    out = []
    for case in root.iter("testcase"):
        outcome, message = "passed", ""
        for tag, name in (("failure", "failed"), ("error", "failed"), ("skipped", "skipped")):
            node = case.find(tag)
            if node is not None:
                outcome = name
                message = (node.get("message") or node.text or "").strip().splitlines()
                message = message[0][:300] if message else ""
                break
        out.append({"name": case.get("name") or case.get("classname"), "outcome": outcome,
                    "seconds": float(case.get("time") or 0.0), "message": message})
    return out
