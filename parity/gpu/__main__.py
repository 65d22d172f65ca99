"""`python -m parity.gpu [--out DIR] [--quick] [--dry-run] [--md PATH] [--render JSON]`

Everything this project measures on a GPU, in one command that fits a short lease
(full: 8 minutes on one H100, --quick: 3). In order, each step under its own time cap
(parity/gpu/plan.py) and guarded, so a failure is recorded and the next step runs:
machine, correctness, speed, varlen, decode. Writes DIR/gpu.json (the results),
DIR/gpu.log (everything the steps printed) and DIR/gpu-section.md, updates
BENCHMARKS.md's GPU section (and results.json, and parity/bench/results/gpu.json)
unless --md none, and prints a short table last.

--dry-run runs the same orchestration on the CPU at tiny shapes (Triton's interpreter,
stand-ins for CUDA and fla, named as such in the output); it leaves BENCHMARKS.md alone
unless --md names a file. --render JSON rewrites the section from an earlier run's
gpu.json (no GPU needed).
"""

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback

from . import plan as plans, render
from .child import Child
from .plan import STEPS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCHMARKS = os.path.join(ROOT, "BENCHMARKS.md")
RESULTS = os.path.join(ROOT, "parity", "bench", "results", "results.json")
JSON_COPY = os.path.join(ROOT, "parity", "bench", "results", "gpu.json")
DEFAULT_OUT = os.path.join(tempfile.gettempdir(), "gla-bridge-gpu-kit")
# what each child would import first: once, in the fork server. On a GPU only what
# leaves CUDA alone (bridge.kernels asks torch for a device, which starts the driver:
# a forked child could not use CUDA after that)
PRELOAD = {"gpu": ("numpy", "torch"),
           "cpu": ("numpy", "torch", "bridge.kernels", "torch_side", "jax", "jax_side",
                   "parity.gpu.speed", "parity.gpu.varlen", "parity.gpu.decode")}
HANG_CAP_S = 3.0


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m parity.gpu", description=__doc__.splitlines()[0])
    p.add_argument("--out", default=DEFAULT_OUT, help=f"folder for the outputs ({DEFAULT_OUT})")
    p.add_argument("--quick", action="store_true",
                   help="the 3-minute kit (T=4096 only, fewer tests)")
    p.add_argument("--dry-run", action="store_true",
                   help="the orchestration on the CPU at tiny shapes, with stand-ins (the tests)")
    p.add_argument("--md", help="markdown file whose '## GPU' section is rewritten ('none': "
                                "none; default: BENCHMARKS.md, none for --dry-run)")
    p.add_argument("--render", metavar="JSON", help="measure nothing: rewrite the section (and "
                                                    "results.json, gpu.json) from a gpu.json")
    p.add_argument("--inject", action="append", default=[], metavar="STEP=fail|hang",
                   help="make a step fail, or hang until a cap of 3 s (tests of the guards)")
    a = p.parse_args(argv)
    a.injections = {}
    for item in a.inject:
        step, _, what = item.partition("=")
        if step not in STEPS or what not in ("fail", "hang"):
            p.error(f"--inject takes STEP=fail|hang with STEP one of {STEPS}, got {item!r}")
        a.injections[step] = what
    return a


class Kit:
    """One run: the plan, where things go, and the steps' shared facts."""

    def __init__(self, plan, out, injections, log=print):
        self.plan, self.out, self.injections, self.print = plan, out, injections, log
        self.log_path = os.path.join(out, "gpu.log")
        self.rows_dir = tempfile.mkdtemp(prefix="gla-kit-rows-")
        self.preload = PRELOAD["cpu" if plan.dry else "gpu"]
        self.machine = {}
        self.background = []

    def say(self, msg):
        self.print(msg)
        with open(self.log_path, "a") as f:
            f.write(f"[kit {time.strftime('%H:%M:%S')}] {msg}\n")

    def child(self, step, target, cap_s, tag, **kwargs) -> Child:
        self.say(f"{tag}: start, cap {cap_s:.0f} s")
        return Child(target, dict(kwargs, plan=self.plan), log_path=self.log_path,
                     rows_path=os.path.join(self.rows_dir, f"{tag}.jsonl"), cap_s=cap_s,
                     preload=self.preload, inject=self.injections.get(step))

    def close(self):
        for c in self.background:
            c.kill()
        shutil.rmtree(self.rows_dir, ignore_errors=True)


def _left(deadline):
    return deadline - time.monotonic()


def step_machine(kit, deadline):
    out = kit.child("machine", "parity.gpu.machine:run", _left(deadline), "machine").wait()
    if out["result"] is None:  # the facts it read before failing, without the ceilings
        facts = [r for r in out["rows"] if r["kind"] == "facts"]
        out["result"] = {k: v for k, v in facts[-1].items() if k != "kind"} if facts else None
    kit.machine = out["result"] or {}
    return out


def step_correctness(kit, deadline):
    # meanwhile our later calls and fla's autotune configs compile (parity/gpu/ahead.py)
    p, cap = kit.plan, _left(deadline) + kit.plan.speed_caps["fla_tune"]
    kit.background = [kit.child(None, "parity.gpu.ahead:ours", cap, f"ahead-ours-{i}",
                                worker=i, workers=p.ahead_workers)
                      for i in range(p.ahead_workers)]
    kit.background += [kit.child(None, "parity.gpu.ahead:fla_compile", cap, f"ahead-fla-{i}",
                                 worker=i, workers=p.fla_workers)
                       for i in range(p.fla_workers)]
    return kit.child("correctness", "parity.gpu.correctness:run", _left(deadline),
                     "correctness").wait()


def _worst(parts):
    for status in ("timed_out", "error"):
        bad = [n for n, o in parts.items() if o["status"] == status]
        if bad:
            return status, "; ".join(f"{n}: {parts[n]['error']}" for n in bad)
    return "ok", None


def _part(kit, target, cap_s, tag, **kwargs):
    """A speed child's outcome; one with under a second left is not started."""
    if cap_s < 1:
        return {"status": "timed_out", "wall_s": 0.0, "rows": [], "result": None,
                "error": "not started: no time left in the step's cap"}
    return kit.child("speed", target, cap_s, tag, **kwargs).wait()


def step_speed(kit, deadline):
    """The compiles started in step 2 finish (or are cut off), fla's autotuning runs alone,
    then the torch and JAX timings, one after the other."""
    p = kit.plan
    warm_end = min(time.monotonic() + p.speed_caps["fla_tune"], deadline)
    ahead = [c.wait(until=warm_end) for c in kit.background]
    kit.background = []
    parts = {"fla_tune": _part(kit, "parity.gpu.ahead:fla_tune", _left(warm_end), "fla-tune")}
    parts["torch"] = _part(kit, "parity.gpu.speed:torch_child",
                           min(p.speed_caps["torch"], _left(deadline) - 5), "speed-torch",
                           tf_peak=kit.machine.get("matmul_tflops") or 989.0,
                           gb_peak=kit.machine.get("copy_gbps") or 3350.0)
    parts["jax"] = _part(kit, "parity.gpu.speed:jax_child",
                         min(p.speed_caps["jax"], _left(deadline)), "speed-jax")
    status, error = _worst(parts)
    tune = parts["fla_tune"]
    calls = [r for r in tune["rows"] if r.get("kind") == "call"]
    note = (tune["result"] or {}).get("stand_in") or (tune["result"] or {}).get("skipped")
    ahead = (f"{sum(o['status'] == 'ok' for o in ahead)} of {len(ahead)} compile-ahead workers "
             f"(ours, fla's configs) finished in {max((o['wall_s'] for o in ahead), default=0):.0f}"
             f" s; fla's autotuning ({tune['status']}, {tune['wall_s']:.0f} s) made "
             f"{sum('error' not in r for r in calls)} of {len(calls)} calls"
             + (f" ({note})" if note else "") + (f" ({tune['error']})" if tune["error"] else ""))
    rows = [r for o in parts.values() for r in o["rows"]]
    result = dict(B=p.B, H=p.H, K=p.K, V=p.V, Ts=list(p.Ts), ahead=ahead,
                  parts={n: {k: o[k] for k in ("status", "wall_s", "error")}
                         for n, o in parts.items()})
    return {"status": status, "rows": rows, "result": result, "error": error}


def step_varlen(kit, deadline):
    return kit.child("varlen", "parity.gpu.varlen:run", _left(deadline), "varlen").wait()


def step_decode(kit, deadline):
    return kit.child("decode", "parity.gpu.decode:run", _left(deadline), "decode").wait()


STEP_FNS = {"machine": step_machine, "correctness": step_correctness, "speed": step_speed,
            "varlen": step_varlen, "decode": step_decode}


def _commit():
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                             capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        if out.returncode != 0:
            return "unknown"
        return out.stdout.strip() + ("+changes" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _environment(plan):
    """Settings every child inherits (the fork server starts with them)."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    if plan.dry:  # the CPU, whatever this machine has
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["JAX_PLATFORMS"] = "cpu"


def run_kit(out, quick=False, dry=False, md=None, results_json=None, json_copy=None,
            injections=None, command="python -m parity.gpu", log=print) -> dict:
    """Run every step (module doc); the validated result, also written to OUT/gpu.json."""
    plan = plans.get(quick=quick, dry=dry)
    injections = injections or {}
    _environment(plan)
    os.makedirs(out, exist_ok=True)
    for name in ("gpu.log", "gpu.json", "gpu-section.md"):
        if os.path.exists(os.path.join(out, name)):
            os.remove(os.path.join(out, name))
    kit = Kit(plan, out, injections, log)
    t0 = time.monotonic()
    end = t0 + plan.budget_s
    result = {"schema": render.SCHEMA, "kit": plan.name, "command": command,
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "commit": _commit(), "budget_s": plan.budget_s, "wall_s": 0.0,
              "stand_ins": list(plan.stand_ins), "steps": []}
    try:
        for name in STEPS:
            cap = min(plan.caps[name], end - time.monotonic())
            if injections.get(name) == "hang":
                cap = min(cap, HANG_CAP_S)
            rec = {"name": name, "cap_s": round(cap, 1), "estimate_s": plan.estimates[name]}
            s0 = time.monotonic()
            if cap < 1:
                out_ = {"status": "skipped", "error": "no time left in the kit's budget",
                        "rows": [], "result": None}
            else:
                kit.say(f"== {name} (cap {cap:.0f} s, estimate {plan.estimates[name]} s)")
                try:
                    out_ = STEP_FNS[name](kit, s0 + cap)
                except Exception as e:  # the orchestration itself failed: recorded, go on
                    kit.say(traceback.format_exc())
                    out_ = {"status": "error", "error": f"{type(e).__name__}: {e}", "rows": [],
                            "result": None}
            rec.update(status=out_["status"], wall_s=round(time.monotonic() - s0, 2),
                       error=out_.get("error"), result=out_.get("result") or {},
                       rows=out_.get("rows") or [])
            result["steps"].append(rec)
            kit.say(f"== {name}: {rec['status']} in {rec['wall_s']:.1f} s"
                    + (f" ({rec['error']})" if rec["error"] else ""))
            _write(out, result, t0)
    finally:
        kit.close()
    result["wall_s"] = round(time.monotonic() - t0, 1)
    render.validate(result)
    _write(out, result, t0)
    with open(os.path.join(out, "gpu-section.md"), "w") as f:
        f.write(render.markdown(result))
    written = render.update_files(result, md, results_json, json_copy)
    if written:
        kit.say("updated " + ", ".join(written))
    return result


def _write(out, result, t0):
    result["wall_s"] = round(time.monotonic() - t0, 1)
    with open(os.path.join(out, "gpu.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    md = args.md if args.md is not None else (None if args.dry_run else BENCHMARKS)
    md = None if md == "none" else md
    default_files = md == BENCHMARKS
    if args.render:
        result = render.load(args.render)
        written = render.update_files(result, md, RESULTS if default_files else None,
                                      JSON_COPY if default_files else None)
        print("wrote " + (", ".join(written) or "nothing (--md none)"))
        print(render.table(result))
        return
    result = run_kit(args.out, quick=args.quick, dry=args.dry_run, md=md,
                     results_json=RESULTS if default_files else None,
                     json_copy=JSON_COPY if default_files else None,
                     injections=args.injections,
                     command="python -m parity.gpu " + " ".join(argv),
                     log=lambda m: print(m, flush=True))
    print(f"outputs in {args.out}: gpu.json, gpu.log, gpu-section.md")
    print(render.table(result), flush=True)


if __name__ == "__main__":
    main()
