"""One piece of a kit step, run in a child process under a hard time cap.

`Child("parity.gpu.speed:torch_child", kwargs, ...)` forks from a fork server (which
imported the heavy modules once: children start in milliseconds, and none inherits a
CUDA context, since the kit's own process never touches CUDA). The child leads a new
session, so at the cap it is killed with everything it started (pytest's workers, fla's
compile workers); its stdout and stderr go to the kit's log. The target is called as
target(emit, deadline, **kwargs): `emit(kind, **record)` appends a JSON line at once,
so what a killed child measured survives it; `deadline` (time.monotonic(), shared by
all processes) lets it stop before the cap. Its return value is the piece's result.
"""

import importlib
import json
import multiprocessing
import os
import signal
import sys
import time
import traceback

_CONTEXT = {}


def _context(preload):
    key = tuple(preload)
    if key not in _CONTEXT:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(list(preload))
        _CONTEXT[key] = ctx
    return _CONTEXT[key]


def _entry(target, kwargs, log_path, rows_path, deadline, inject):
    os.setsid()
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)

    def emit(kind, **record):
        with open(rows_path, "a") as f:
            f.write(json.dumps({"kind": kind, **record}, default=str) + "\n")

    try:
        if inject == "fail":
            raise RuntimeError("failure injected by --inject (a test of the kit's guards)")
        if inject == "hang":
            while True:
                time.sleep(1)
        module, name = target.split(":")
        result = getattr(importlib.import_module(module), name)(emit, deadline, **kwargs)
        emit("result", result=result)
    except BaseException as e:
        traceback.print_exc()
        emit("error", error=f"{type(e).__name__}: {e}"[:2000])
        sys.stdout.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class Child:
    """A started child (see the module doc); `wait()` gives its outcome."""

    def __init__(self, target, kwargs, *, log_path, rows_path, cap_s, preload=(), inject=None):
        self.target, self.rows_path, self.cap_s = target, rows_path, max(cap_s, 0.0)
        self.t0 = time.monotonic()
        self.deadline = self.t0 + self.cap_s
        if os.path.exists(rows_path):
            os.remove(rows_path)
        ctx = _context(preload)
        self.proc = ctx.Process(target=_entry, args=(target, kwargs, log_path, rows_path,
                                                     self.deadline - 2.0, inject), daemon=False)
        self.proc.start()

    def wait(self, until=None) -> dict:
        """Block until the child ends or its cap (or `until`, earlier) passes, then kill it
        with its session. {status: ok | error | timed_out, wall_s, rows, result, error}."""
        end = self.deadline if until is None else min(until, self.deadline)
        self.proc.join(max(end - time.monotonic(), 0.0))
        timed_out = self.proc.is_alive()
        if timed_out:
            self.kill()
        wall = time.monotonic() - self.t0
        rows, result, error = [], None, None
        for rec in _records(self.rows_path):
            kind = rec.pop("kind", None)
            if kind == "result":
                result = rec.get("result")
            elif kind == "error":
                error = rec.get("error")
            else:
                rows.append(dict(rec, kind=kind))
        if timed_out:
            status = "timed_out"
            error = f"killed at its cap of {end - self.t0:.0f} s" + (f" ({error})" if error else "")
        elif self.proc.exitcode != 0 or error:
            status = "error"
            error = error or f"exit code {self.proc.exitcode}"
        else:
            status = "ok"
        return {"status": status, "wall_s": round(wall, 2), "rows": rows, "result": result,
                "error": error}

    def kill(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            self.proc.kill()
        self.proc.join(10)


def _records(path):
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:  # the line a killed child was writing
            pass
    return out


def run(target, kwargs, **options) -> dict:
    """Start a Child and wait for it."""
    return Child(target, kwargs, **options).wait()
