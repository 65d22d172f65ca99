"""Step "correctness": correctness on the device: `tests/test_cuda.py` under pytest, in this child
process (its xdist workers are its own children). The file holds the compiled kernels of
both families from torch and JAX against the float64 oracle, the (8,4096,16,128,128)
chunk-vs-fused test, torch.compile(fullgraph=True) of both layers through the triton_op
path, JAX arrays committed to the CPU reaching the compiled kernels, and varlen without a
host sync. Each test's outcome is emitted the moment pytest reports it, so a run killed
at its cap keeps every test that finished."""

import os
import shlex

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = "tests/test_cuda.py"


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
        self.emit("test", name=name, outcome=outcome, seconds=round(seconds, 2),
                  message=message[:300])

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


def run(emit, deadline, *, plan):
    import pytest

    args = [TESTS, "-q", "-p", "no:cacheprovider", *_args(plan)]
    print("correctness: pytest", shlex.join(args), flush=True)
    os.chdir(ROOT)
    recorder = Recorder(emit)
    code = int(pytest.main(args, plugins=[recorder]))
    return {"command": "python -m pytest " + shlex.join([TESTS, *_args(plan)]),
            "exit_code": code, "counts": recorder.counts}
