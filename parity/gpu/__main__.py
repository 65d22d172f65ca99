"""`python -m parity.gpu [--out DIR] [--quick] [--dry-run] [--fla-configs FILE] [--md PATH]
[--render JSON]`

Everything this project measures on a GPU, in one command with a fixed time budget
(full: 10 minutes on one H100 or H200, --quick: 3). In order, each step under its own
time cap (parity/gpu/plan.py) and guarded, so a failure is recorded and the next step
runs: machine, correctness, tune (fla's autotuning), speed, varlen, decode, kernels
(per-kernel device times), sweep (launch configs). Within a step each measurement is
its own row with its own status (parity/gpu/rows.py). Writes DIR/gpu.json (the
results), DIR/gpu.log (everything the steps printed), DIR/gpu-section.md,
DIR/fla-configs.json (fla's autotuner winners: pass it as --fla-configs to a later run
so that it tunes nothing), DIR/tuning.json (the device table: the sweep's configs and
mode="auto"'s ranking of the families from the speed rows, parity/gpu/ranking.py;
`python -m bridge.tuning --merge` ships it) and DIR/properties.jsonl (the property tests' failing
problems, the shrunk one last), updates BENCHMARKS.md's GPU section (and results.json,
and parity/bench/results/gpu.json) unless --md none, and prints a short table last.

--dry-run runs the same orchestration on the CPU at tiny shapes (Triton's interpreter,
stand-ins for CUDA and fla, named as such in the output); it leaves BENCHMARKS.md alone
unless --md names a file. --render JSON rewrites the section from an earlier run's
gpu.json (no GPU needed).
"""

import argparse
import dataclasses
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback

from . import decode, kernels, plan as plans, ranking, render, rows, speed, varlen
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
                   "parity.gpu.speed", "parity.gpu.varlen", "parity.gpu.decode",
                   "parity.gpu.kernels", "parity.gpu.sweep")}
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
    p.add_argument("--fla-configs", metavar="FILE", help="fla's autotuner winners from an "
                                                         "earlier run (its fla-configs.json): "
                                                         "no tuning")
    p.add_argument("--inject", action="append", default=[], metavar="STEP=fail|hang",
                   help="make a step fail, or hang until a cap of 3 s; fla=absent: run as "
                        "if fla-core were not installed (tests of the guards)")
    a = p.parse_args(argv)
    a.injections = {}
    for item in a.inject:
        step, _, what = item.partition("=")
        if (step, what) != ("fla", "absent") and (step not in STEPS
                                                   or what not in ("fail", "hang")):
            p.error(f"--inject takes STEP=fail|hang with STEP one of {STEPS}, or fla=absent, "
                    f"got {item!r}")
        a.injections[step] = what
    if a.fla_configs and not os.path.exists(a.fla_configs):
        p.error(f"--fla-configs: no file {a.fla_configs!r}")
    return a


class Kit:
    """One run: the plan, where things go, and the steps' shared facts."""

    def __init__(self, plan, out, injections, log=print, fla_configs=None):
        self.plan, self.out, self.injections, self.print = plan, out, injections, log
        self.fla_configs = os.path.abspath(fla_configs) if fla_configs else None
        self.fla_out = os.path.join(out, "fla-configs.json")  # what the timed children load
        self.log_path = os.path.join(out, "gpu.log")
        self.rows_dir = tempfile.mkdtemp(prefix="gla-kit-rows-")
        self.preload = PRELOAD["cpu" if plan.dry else "gpu"]
        self.machine = {}
        self.background = {}  # tag -> Child: the compiles ahead

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
        for c in self.background.values():
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
    p = kit.plan
    cap = _left(deadline) + p.caps["tune"]
    kit.background = {f"ahead-ours-{i}": kit.child(None, "parity.gpu.ahead:ours", cap,
                                                   f"ahead-ours-{i}", worker=i,
                                                   workers=p.ahead_workers)
                      for i in range(p.ahead_workers)}
    kit.background.update({f"ahead-fla-{i}": kit.child(
        None, "parity.gpu.ahead:fla_compile", cap, f"ahead-fla-{i}", worker=i,
        workers=p.fla_workers, configs=kit.fla_configs) for i in range(p.fla_workers)})
    log = os.path.join(kit.out, "properties.jsonl")
    seed = int(time.time()) % 2 ** 31
    out = kit.child("correctness", "parity.gpu.correctness:run", _left(deadline),
                    "correctness", property_log=log, seed=seed).wait()
    if p.property_s and out["result"] is None:  # killed: the log keeps what failed
        from .correctness import read_properties

        out["result"] = {"properties": read_properties(log, seed, p.property_s)}
    return out


def _worst(parts):
    for status in ("timed_out", "error"):
        bad = [n for n, o in parts.items() if o["status"] == status]
        if bad:
            return status, "; ".join(f"{n}: {parts[n]['error']}" for n in bad)
    return "ok", None


def step_tune(kit, deadline):
    """The compiles started beside the correctness step finish (or are cut off, leaving
    the tuning its reserve), then fla's autotuning runs alone on the GPU (ahead.py);
    given --fla-configs, the compiles have the whole cap and nothing is tuned."""
    p = kit.plan
    reserve = 1 if kit.fla_configs else p.tune_reserve_s
    ahead = {tag: c.wait(until=deadline - reserve) for tag, c in kit.background.items()}
    kit.background = {}
    if kit.fla_configs and p.fla != "absent":
        from . import fla

        records = fla.read_winners(kit.fla_configs)
        fla.write_records(kit.fla_out, records, f"loaded from {kit.fla_configs}")
        out = {"status": "ok", "wall_s": 0.0, "rows": [], "error": None,
               "result": {"source": kit.fla_configs, "winners": len(records), "tuned": False}}
    else:
        out = kit.child("tune", "parity.gpu.ahead:fla_tune", _left(deadline), "fla-tune",
                        out_path=kit.fla_out).wait()
    compile_s = max((o["wall_s"] for n, o in ahead.items() if n.startswith("ahead-fla")),
                    default=0.0)
    result = dict(out["result"] or {}, compile_ahead={
        n: {"status": o["status"], "wall_s": o["wall_s"], "error": o["error"],
            "calls": sum(r.get("status") == "ok" for r in o["rows"] if r["kind"] == "call"),
            "of": sum(r["kind"] == "call" for r in o["rows"])} for n, o in ahead.items()})
    result["fla_compile_s"] = compile_s
    if result.get("tuned"):  # fla's cold start: its configs compiled, then tuned
        result["fla_cold_s"] = round(compile_s + out["wall_s"], 1)
    if not os.path.exists(kit.fla_out):
        result.setdefault("source", "none: no winners written")
    return dict(out, result=result)


def _part(kit, target, cap_s, tag, expected, keys, **kwargs):
    """A speed child's outcome, its rows completed (rows.complete); one with under a
    second left is not started."""
    if cap_s < 1:
        out = {"status": "timed_out", "wall_s": 0.0, "rows": [], "result": None,
               "error": "not started: no time left in the step's cap"}
    else:
        out = kit.child("speed", target, cap_s, tag, **kwargs).wait()
    return dict(out, rows=rows.complete(expected, out, keys))


ROW_KEYS = ("impl", "T", "mode")


def step_speed(kit, deadline):
    """Ours from torch, fla, ours from JAX: three children one after the other, each
    with its own cap, so that one's failure leaves the others' rows."""
    p = kit.plan
    left = lambda part: min(p.speed_caps[part], _left(deadline))  # noqa: E731
    parts = {"ours": _part(kit, "parity.gpu.speed:ours_child", left("ours"), "speed-ours",
                           speed.expected(p, "ours"), ROW_KEYS,
                           tf_peak=kit.machine.get("matmul_tflops") or 989.0,
                           gb_peak=kit.machine.get("copy_gbps") or 3350.0)}
    parts["fla"] = _part(kit, "parity.gpu.speed:fla_child", left("fla"), "speed-fla",
                         speed.expected(p, "fla"), ROW_KEYS, configs=kit.fla_out)
    parts["jax"] = _part(kit, "parity.gpu.speed:jax_child", left("jax"), "speed-jax",
                         speed.expected(p, "jax"), ROW_KEYS)
    status, error = _worst(parts)
    result = dict(B=p.B, H=p.H, K=p.K, V=p.V, Ts=list(p.Ts),
                  parts={n: {k: o[k] for k in ("status", "wall_s", "error")}
                         for n, o in parts.items()})
    return {"status": status, "rows": [r for o in parts.values() for r in o["rows"]],
            "result": result, "error": error}


def _completed(kit, step, target, deadline, expected, keys, kind="row", **kwargs):
    out = kit.child(step, target, _left(deadline), step, **kwargs).wait()
    return dict(out, rows=rows.complete(expected, out, keys, kind))


def step_varlen(kit, deadline):
    return _completed(kit, "varlen", "parity.gpu.varlen:run", deadline,
                      varlen.expected(kit.plan), ("impl", "mode"), configs=kit.fla_out)


def step_decode(kit, deadline):
    return _completed(kit, "decode", "parity.gpu.decode:run", deadline,
                      decode.expected(kit.plan), ("impl", "batch"), configs=kit.fla_out)


def step_kernels(kit, deadline):
    return _completed(kit, "kernels", "parity.gpu.kernels:run", deadline,
                      kernels.expected(kit.plan), ("impl",), kind="profile",
                      configs=kit.fla_out)


def step_sweep(kit, deadline):
    return kit.child("sweep", "parity.gpu.sweep:run", _left(deadline), "sweep",
                     out_path=os.path.join(kit.out, "tuning.json")).wait()


STEP_FNS = {"machine": step_machine, "correctness": step_correctness, "tune": step_tune,
            "speed": step_speed, "varlen": step_varlen, "decode": step_decode,
            "kernels": step_kernels, "sweep": step_sweep}


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
            injections=None, command="python -m parity.gpu", log=print, fla_configs=None) -> dict:
    """Run every step (module doc); the validated result, also written to OUT/gpu.json."""
    plan = plans.get(quick=quick, dry=dry)
    injections = injections or {}
    if injections.get("fla") == "absent":
        plan = dataclasses.replace(plan, fla="absent")
    _environment(plan)
    os.makedirs(out, exist_ok=True)
    for name in ("gpu.log", "gpu.json", "gpu-section.md", "fla-configs.json", "tuning.json",
                 "properties.jsonl"):
        if os.path.exists(os.path.join(out, name)):
            os.remove(os.path.join(out, name))
    kit = Kit(plan, out, injections, log, fla_configs)
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
            if name in render.SECTIONS:  # the JSON's own keys for these two steps
                result[name] = {"status": rec["status"], "result": rec["result"],
                                "rows": rec["rows"]}
            kit.say(f"== {name}: {rec['status']} in {rec['wall_s']:.1f} s"
                    + (f" ({rec['error']})" if rec["error"] else ""))
            _write(out, result, t0)
    finally:
        kit.close()
    try:  # mode="auto"'s ranking from the speed rows, into the sweep's device table
        result["ranking"] = ranking.write(os.path.join(out, "tuning.json"), result, plan,
                                          kit.machine)
        kit.say(f"ranking for mode='auto': {result['ranking']['entries'] or 'none'}")
    except Exception as e:  # the kit's results stand without it
        result["ranking"] = {"error": f"{type(e).__name__}: {e}"}
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
                     injections=args.injections, fla_configs=args.fla_configs,
                     command="python -m parity.gpu " + " ".join(argv),
                     log=lambda m: print(m, flush=True))
    print(f"outputs in {args.out}: gpu.json, gpu.log, gpu-section.md")
    print(render.table(result), flush=True)


if __name__ == "__main__":
    main()
