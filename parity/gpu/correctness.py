"""Step "correctness": correctness on the device: `tests/test_cuda.py` under pytest, in this child
process (its xdist workers are its own children). The file holds the compiled kernels of
both families from torch and JAX against the float64 oracle, the (8,4096,16,128,128)
chunk-vs-fused test, torch.compile(fullgraph=True) of both layers through the triton_op
path, JAX arrays committed to the CPU reaching the compiled kernels, and varlen without a
host sync. Beside it, when the plan gives them seconds, the property tests of every
compiled Triton launch (tests/test_properties.py, test_compiled_matches_oracle): hypothesis
draws from a recorded seed for a fixed time a backend, against the float64 oracle; each
failing problem is logged the moment it fails, so the shrunk case survives a run killed at
its cap (`properties`). Each test's outcome is emitted the moment pytest reports it, so a
run killed at its cap keeps every test that finished."""

import json
import os
import shlex
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = "tests/test_cuda.py"
PROPERTIES = "tests/test_properties.py::test_compiled_matches_oracle"


class Recorder:
    """A pytest plugin: one {name, outcome, seconds, message} row per test (and per
    module skipped or broken whole), emitted at once; `counts` by outcome."""

    def __init__(self, emit):
        self.emit, self.counts = emit, {"passed": 0, "failed": 0, "skipped": 0}

    def _row(self, name, outcome, seconds, longrepr):
        outcome = "failed" if outcome not in self.counts else outcome
        self.counts[outcome] += 1
        if isinstance(longrepr, tuple):  # a skip: (path, line, reason)
            message = str(longrepr[-1])
        else:
            lines = str(longrepr or "").strip().splitlines()
            message = next((line for line in reversed(lines) if line.startswith("E ")),
                           lines[-1] if lines else "")
        text = str(longrepr or "")
        shrunk = text[text.find("Falsifying example"):][:600] if "Falsifying example" in text \
            else None
        self.emit("test", name=name, outcome=outcome, seconds=round(seconds, 2),
                  message=message[:300], **({"falsifying": shrunk} if shrunk else {}))

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            self._row(report.nodeid.split("::", 1)[-1], report.outcome, report.duration,
                      report.longrepr)

    def pytest_collectreport(self, report):
        if report.outcome != "passed":
            self._row(report.nodeid, report.outcome, 0.0, report.longrepr)


def _args(plan):
    """The plan's pytest arguments, less xdist's where it is not installed."""
    import importlib.util

    args = list(plan.pytest_args)
    if importlib.util.find_spec("xdist") is None and "-n" in args:
        i = args.index("-n")
        del args[i:i + 2]
        if "--dist" in args:
            i = args.index("--dist")
            del args[i:i + 2]
    return args


def read_properties(path, seed, seconds) -> dict:
    """The property run's record from its log (tests/test_properties.py, timed_property):
    {seed, seconds_each, backends: {name: {checked, seconds, passed, shrunk, error}}}; a
    backend without its closing line (cut off at the cap) has passed None."""
    out = {}
    if path and os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    row = json.loads(line)
                except ValueError:  # a line cut off by the kill
                    continue
                rec = out.setdefault(row.pop("label"), {"passed": None, "shrunk": None})
                if "problem" in row:  # the last failure logged is the shrunk one
                    rec.update(shrunk=row["problem"], error=row["error"])
                else:
                    rec.update(row)
    return {"seed": seed, "seconds_each": seconds, "backends": out}


def property_args(plan, seed) -> list:
    """pytest arguments that add the compiled launches' property tests (none without
    seconds in the plan)."""
    return [PROPERTIES, f"--hypothesis-seed={seed}"] if plan.property_s else []


def run(emit, deadline, *, plan, property_log=None, seed=None):
    import pytest

    seed = int(time.time()) % 2 ** 31 if seed is None else seed
    tests = [TESTS, *property_args(plan, seed)]
    if plan.property_s:
        os.environ["GLA_PROPERTY_SECONDS"] = str(plan.property_s)
        if property_log:
            os.environ["GLA_PROPERTY_LOG"] = property_log
    args = [*tests, "-q", "-p", "no:cacheprovider", *_args(plan)]
    print("correctness: pytest", shlex.join(args), flush=True)
    os.chdir(ROOT)
    recorder = Recorder(emit)
    code = int(pytest.main(args, plugins=[recorder]))
    out = {"command": "python -m pytest " + shlex.join([*tests, *_args(plan)]),
           "exit_code": code, "counts": recorder.counts}
    if plan.property_s:
        out["properties"] = read_properties(property_log, seed, plan.property_s)
    return out
