"""`python -m parity.bench [--quick] [--shapes B,H,K,V ...] [--T ...] [--impl ...] [--out DIR]`

Verifies every implementation against the oracle, times them side by side
over T, and writes BENCHMARKS.md, DIR/results.json and DIR/*.png.
The allocator settings must be in the environment before the process starts,
so the script re-executes itself with them when they are missing.
"""

import argparse
import datetime
import importlib.metadata
import os
import sys

from . import report, timing

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_OUT = os.path.join(ROOT, "parity", "bench", "results")
# measurements by hand that no command reruns (why the CPU paths' knobs have their values)
TUNING_HISTORY = "## Tuning history of the CPU paths"
SHAPES = [(2, 8, 64, 64), (1, 4, 128, 128)]
TS = [512, 1024, 2048, 4096, 8192]
QUICK_SHAPES = [(1, 2, 16, 16)]
QUICK_TS = [96]  # the check size: the JAX paths reuse the check's compilation
VERSIONS = ("torch", "jax", "jaxlib", "triton", "ejkernel", "fla-core", "numpy")


def _shape(text):
    try:
        dims = tuple(int(x) for x in text.split(","))
    except ValueError:
        dims = ()
    if len(dims) != 4 or min(dims) <= 0:
        raise argparse.ArgumentTypeError(f"--shapes takes B,H,K,V (4 positive ints), got {text!r}")
    return dims


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m parity.bench", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, seconds (for the tests)")
    p.add_argument("--shapes", type=_shape, nargs="+",
                   help="B,H,K,V ... (default: 2,8,64,64 1,4,128,128)")
    p.add_argument("--T", type=int, nargs="+", help="sequence lengths (default 512..8192)")
    p.add_argument("--impl", nargs="+", help="implementation names to run (default: all)")
    p.add_argument("--out", default=DEFAULT_OUT, help="folder for results.json and the plots")
    p.add_argument("--md", help="markdown path (default: BENCHMARKS.md at the repository root "
                                "for the default --out, else OUT/BENCHMARKS.md)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds per call before 'over budget'")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--group-json", help=argparse.SUPPRESS)  # internal: one framework's child run
    p.add_argument("--render", metavar="JSON", help="measure nothing: rewrite the markdown and "
                                                     "plots from an earlier run's results.json")
    p.add_argument("--readiness", action="store_true",
                   help="only refresh the GPU- and TPU-readiness sections (the AOT and Mosaic "
                        "reports, no GPU or TPU needed) in OUT/results.json, and rewrite the "
                        "markdown from it")
    p.add_argument("--gpu", action="store_true",
                   help="only refresh the GPU section (needs a CUDA device, a few minutes) in "
                        "OUT/results.json, and rewrite the markdown from it")
    p.add_argument("--compile-time", action="store_true",
                   help="only refresh the torch.compile-time section (cold compiles of the "
                        "torch layers, a few minutes) in OUT/results.json, and rewrite the "
                        "markdown from it")
    p.add_argument("--multidevice", action="store_true",
                   help="only refresh the multi-device section (context parallelism on 8 host "
                        "devices, a few minutes) in OUT/results.json, and rewrite the markdown")
    p.add_argument("--decode", action="store_true",
                   help="only refresh the decode section (the layers' per-token time, both "
                        "frameworks, a few minutes) in OUT/results.json, and rewrite the "
                        "markdown from it")
    a = p.parse_args(argv)
    if a.T is not None and min(a.T) <= 0:
        p.error(f"--T must be positive, got {a.T}")
    if a.budget is not None and a.budget <= 0:
        p.error(f"--budget must be positive, got {a.budget}")
    return a


def _reexec_with_malloc_env(argv):
    """glibc reads these once at start-up: set them and restart this process."""
    if all(os.environ.get(k) == v for k, v in timing.MALLOC_ENV.items()):
        return
    env = dict(os.environ, **timing.MALLOC_ENV)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "parity.bench", *argv], env)


def machine_info(threads) -> dict:
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), cpu)
    except OSError:
        pass
    versions = {}
    for name in VERSIONS:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
            "cpu": cpu, "cores": os.cpu_count(), "threads": threads, "versions": versions}


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    if args.render:
        return render(args)
    if args.readiness:
        from . import readiness

        return refresh(args, "readiness", readiness.run)
    if args.compile_time:
        from . import compile_time

        return refresh(args, "compile_time", compile_time.run)
    if args.gpu:
        from . import gpu

        if gpu.unavailable():
            raise SystemExit(f"--gpu: {gpu.unavailable()}")
        return refresh(args, "gpu", gpu.section)
    if args.multidevice:
        from . import multidevice

        return refresh(args, "multidevice", multidevice.run)
    if args.decode:
        from .decode import run as run_decode

        return refresh(args, "decode", lambda: run_decode(print))
    _reexec_with_malloc_env(argv)

    import torch

    from . import anchors, runner

    torch.set_num_threads(args.threads)
    shapes = args.shapes or (QUICK_SHAPES if args.quick else SHAPES)
    Ts = args.T or (QUICK_TS if args.quick else TS)
    impls = anchors.cpu_impls()
    if args.impl:
        known = {i.name for i in impls}
        bad = [n for n in args.impl if n not in known]
        if bad:
            raise SystemExit(f"--impl: unknown {bad}; known: {sorted(known)}")
        impls = [i for i in impls if i.name in args.impl]
    settings = runner.Settings(
        budget_s=args.budget or (5.0 if args.quick else runner.Settings().budget_s))
    if args.quick:
        settings.rep_budget_s, settings.min_repeats, settings.repeats = 0.2, 1, 3
        settings.warm_calls = 2

    if args.group_json:  # a child: measure this framework's implementations, hand back JSON
        checks = runner.check_all(impls, settings.log)
        records = runner.sweep(impls, shapes, Ts, settings, checks)
        report.write_json(args.group_json, records, {}, checks)
        return

    machine = machine_info(args.threads)
    machine["matmul_n"] = 512 if args.quick else 2048
    machine["matmul_gflops"] = timing.matmul_gflops(machine["matmul_n"])
    machine["copy_gbps"] = timing.copy_gbps(16 * 2 ** 20 if args.quick else 256 * 2 ** 20)
    t_chunk = report.TARGET_AT if report.TARGET_AT in Ts else max(Ts)
    machine["chunk_matmul"] = [{"shape": list(s), "T": t_chunk,
                                **timing.chunk_matmul_gflops(s, t_chunk)} for s in shapes]
    machine["budget_s"] = settings.budget_s
    machine["command"] = "python -m parity.bench " + " ".join(argv)

    records, checks = _run_groups(args, impls, settings.log)

    gpu_section = gpu_markdown(args, settings.log)
    from . import readiness

    from . import compile_time

    ready = None if args.quick else readiness.run(settings.log)
    compiled = None if args.quick else compile_time.run(settings.log)
    from . import decode, profile

    decoded = None if args.quick else decode.run(settings.log)
    stages = None if args.quick else profile.run(settings.log)
    os.makedirs(args.out, exist_ok=True)
    json_path = os.path.join(args.out, "results.json")
    # the 8-device section has its own run (--multidevice): a full run keeps the stored one
    multi = None if args.quick else _stored(args, "multidevice")
    report.write_json(json_path, records, machine, checks, gpu_section, ready, compiled,
                      decode=decoded, profile=stages, multidevice=multi)
    _write_outputs(args, records, impls, machine, checks, gpu_section, json_path, settings.log,
                   ready, compiled, multi, decode=decoded, profile=stages)


def _run_groups(args, impls, log):
    """Each framework's implementations in a child process of their own: they are
    compared with each other (alternating, one process), never across frameworks,
    and a process that has run XLA measured torch up to 2x slower here."""
    import json
    import subprocess
    import tempfile

    keep = ["--threads", str(args.threads)] + (["--quick"] if args.quick else [])
    if args.shapes:
        keep += ["--shapes", *(",".join(map(str, sh)) for sh in args.shapes)]
    if args.T:
        keep += ["--T", *map(str, args.T)]
    if args.budget:
        keep += ["--budget", str(args.budget)]
    records, checks = [], {}
    for framework in dict.fromkeys(i.framework for i in impls):
        names = [i.name for i in impls if i.framework == framework]
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "group.json")
            cmd = [sys.executable, "-m", "parity.bench", *keep, "--impl", *names,
                   "--group-json", path]
            log(f"{framework} group: {names}")
            proc = subprocess.run(cmd)
            if proc.returncode != 0 or not os.path.exists(path):
                raise SystemExit(f"the {framework} group failed (exit {proc.returncode}): {cmd}")
            with open(path) as f:
                data = json.load(f)
        records += data["records"]
        checks.update(data["checks"])
    return records, checks


def _write_outputs(args, records, impls, machine, checks, gpu_section, json_path, log,
                   readiness=None, compile_time=None, multidevice=None, decode=None,
                   profile=None):
    from . import anchors

    os.makedirs(args.out, exist_ok=True)
    md_path = args.md or (os.path.join(ROOT, "BENCHMARKS.md")
                          if os.path.abspath(args.out) == DEFAULT_OUT
                          else os.path.join(args.out, "BENCHMARKS.md"))
    md_dir = os.path.dirname(os.path.abspath(md_path))
    machine["json"] = os.path.relpath(os.path.abspath(json_path), md_dir)
    plots = [] if args.no_plot else report.plot(records, impls, args.out)
    text = report.markdown(records, impls, anchors.BASELINES, machine, checks,
                           [os.path.relpath(p, md_dir) for p in plots], gpu_section,
                           readiness, compile_time, multidevice, decode=decode, profile=profile)
    # sections this run does not measure: keep them as they are
    from ..sections import replace_section, section_body
    from ..train import report as train_report

    old = open(md_path).read() if os.path.exists(md_path) else ""
    for heading in (train_report.HEADING, TUNING_HISTORY, report.BY_HAND):
        body = section_body(old, heading)
        if body is not None:
            text = replace_section(text, body, heading)
    with open(md_path, "w") as f:
        f.write(text)
    log(f"wrote {md_path}, {json_path}" + "".join(f", {p}" for p in plots))


def render(args):
    """--render: the markdown and plots again from a stored results.json."""
    import json

    from . import anchors

    with open(args.render) as f:
        data = json.load(f)
    names = {r["impl"] for r in data["records"]}
    impls = [i for i in anchors.cpu_impls() if i.name in names]
    _write_outputs(args, data["records"], impls, data["machine"], data["checks"],
                   data.get("gpu"), args.render, print, data.get("readiness"),
                   data.get("compile_time"), data.get("multidevice"), decode=data.get("decode"),
                   profile=data.get("profile"))


def gpu_markdown(args, log):
    """The GPU section: measured when this machine has a CUDA device; else the one an
    earlier run measured on a GPU (OUT/results.json), else a line saying why not."""
    from . import gpu

    return (_stored(args, "gpu") if gpu.unavailable() else None) or gpu.section(
        quick=args.quick, log=log)


def _stored(args, key):
    """`key` of an earlier run's OUT/results.json, or None."""
    import json

    try:
        with open(os.path.join(args.out, "results.json")) as f:
            return json.load(f).get(key)
    except (OSError, ValueError):
        return None


def refresh(args, key, run):
    """--readiness / --compile-time / --gpu / --multidevice / --decode: `run()`'s new
    results under `key` in OUT/results.json (the CPU timings kept), then the markdown
    again from it."""
    import json

    json_path = os.path.join(args.out, "results.json")
    with open(json_path) as f:
        data = json.load(f)
    data[key] = run()
    with open(json_path, "w") as f:
        json.dump(data, f, indent=1)
    args.render = json_path
    render(args)


if __name__ == "__main__":
    main()
