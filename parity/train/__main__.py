"""`python -m parity.train [--steps N] [--dtype fp32|bf16] [--platform default|triton] [--out DIR]`

Trains one small GLA language model (byte-level, on parity/data/spec.txt) in PyTorch and
in JAX from the same initial weights, on the same batches, with the same AdamW, and
compares the two after every step: the losses, the gradients, the weights. Writes
OUT/training_<platform>_<dtype>.json, redraws OUT/training.png and BENCHMARKS.md's
"Training parity" section from every OUT/training_*.json, and exits 1 when an fp32 run
misses its targets (per-step losses within 1e-5 relative over the first 20 steps and
within 1e-3 at the last).
"""

import argparse
import dataclasses
import os
import sys
import tempfile
import time

import numpy as np

from . import data, lockstep, optim, report

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_OUT = os.path.join(ROOT, "parity", "bench", "results")
PLATFORMS = {"default": ("torch:torch", "jax:xla"), "triton": ("torch:triton", "jax:triton")}
FIRST, FIRST_TOL, LAST_TOL = 20, 1e-5, 1e-3


@dataclasses.dataclass(frozen=True)
class Settings:
    """One run: the model, the data and the optimizer's schedule length."""

    steps: int = 200
    dtype: str = "fp32"
    sides: tuple = PLATFORMS["default"]
    layers: int = 2
    hidden: int = 128
    heads: int = 2
    batch: int = 8
    seq: int = 128
    seed: int = 0
    lr: float = optim.Hyper.lr
    perturb: float = 0.0
    round_trip: int = 0
    probe: tuple = ()

    def config(self):
        from bridge.model_config import GLAConfig

        return GLAConfig(hidden_size=self.hidden, num_hidden_layers=self.layers,
                         num_heads=self.heads, vocab_size=data.VOCAB)

    @property
    def graded(self) -> bool:
        """Whether the issue's targets apply: fp32, torch against JAX, the same start."""
        return self.dtype == "fp32" and not self.perturb and \
            {x.split(":")[0] for x in self.sides} == {"torch", "jax"}

    def hyper(self) -> optim.Hyper:
        return optim.Hyper(lr=self.lr, steps=self.steps, warmup=max(1, min(10, self.steps // 5)))


def side(spec: str) -> tuple:
    """(trainer class, platform) of "torch:<platform>" or "jax:<platform>"."""
    framework, platform = spec.split(":")
    if framework == "torch":
        from .trainer_torch import TorchTrainer as cls
    else:
        from .trainer_jax import JaxTrainer as cls
    return cls, platform


def run(s: Settings, progress=None) -> dict:
    """Train both sides of `s` in lockstep; the JSON record of the run."""
    t0, load = time.time(), os.getloadavg()[0]  # the wall time means little on a busy machine
    config, hyper = s.config(), s.hyper()
    text = data.corpus()
    batches = data.batches(text, s.steps, s.batch, s.seq, s.seed)
    params = lockstep.init_params(config, s.seed)
    (cls_a, plat_a), (cls_b, plat_b) = (side(x) for x in s.sides)
    a = cls_a.start(config, params, hyper, dtype=s.dtype, platform=plat_a)
    if s.perturb:  # an experiment: b starts from weights a relative s.perturb away
        rng = np.random.default_rng(s.seed + 1)
        params = {n: (p * (1 + s.perturb * rng.standard_normal(p.shape))).astype(np.float32)
                  for n, p in params.items()}
    b = cls_b.start(config, params, hyper, dtype=s.dtype, platform=plat_b)
    with tempfile.TemporaryDirectory() as tmp:
        rows, probes = lockstep.lockstep(a, b, batches, save_at=s.round_trip or None,
                                         save_dir=tmp, probe_at=s.probe, progress=progress)
        trip = None
        if s.round_trip:
            trip = lockstep.round_trip(rows, {
                "a->b": cls_b.resume(os.path.join(tmp, a.framework), dtype=s.dtype,
                                     platform=plat_b),
                "b->a": cls_a.resume(os.path.join(tmp, b.framework), dtype=s.dtype,
                                     platform=plat_a)}, batches)
    corpus = dict(file=os.path.relpath(data.CORPUS, ROOT), bytes=len(text),
                  sha256=data.digest(text))
    return dict(settings=dataclasses.asdict(s), config=config.to_dict(), hyper=hyper.to_dict(),
                corpus=corpus, versions=_versions(), cores=os.cpu_count(),
                load_at_start=load, rows=rows, round_trip=trip, probes=probes,
                targets=targets(rows, s.graded), wall_s=round(time.time() - t0, 1))


def targets(rows, graded: bool) -> dict:
    """The issue's targets (`graded`: fp32, torch against JAX) and where the curves part:
    the first step whose loss, gradient or weight difference passes each of 1e-5, 1e-4,
    1e-3, 1e-2."""
    first = max(r["loss_rel"] for r in rows[:FIRST])
    out = dict(first_steps=min(FIRST, len(rows)), first_worst=first, last_step=rows[-1]["step"],
               last=rows[-1]["loss_rel"])
    if graded:
        out |= dict(first_ok=first <= FIRST_TOL, last_ok=rows[-1]["loss_rel"] <= LAST_TOL)
    out["crossings"] = {
        key: {f"{tol:.0e}": next((r["step"] for r in rows if r[key] > tol), None)
              for tol in (1e-5, 1e-4, 1e-3, 1e-2)}
        for key in ("loss_rel", "grad_rel", "weight_rel")}
    return out


def _versions() -> dict:
    import importlib.metadata

    out = {}
    for name in ("torch", "jax", "jaxlib", "flax", "optax", "triton", "numpy"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def _line(r) -> str:
    return (f"step {r['step']:4d}  loss {r['loss'][0]:.6f} {r['loss'][1]:.6f}  "
            f"rel {r['loss_rel']:.1e}  grads {r['grad_rel']:.1e} ({r['grad_worst']})  "
            f"weights {r['weight_rel']:.1e} ({r['weight_worst']})")


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m parity.train",
                                description=__doc__.splitlines()[2])
    p.add_argument("--steps", type=int, help="optimizer steps (default 200; 20 with "
                                             "--platform triton, interpreted on CPU)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                   help="bf16: torch.autocast in torch, the NNX model's dtype=bfloat16 in "
                        "JAX (float32 parameters and optimizer in both)")
    p.add_argument("--platform", choices=sorted(PLATFORMS), default="default",
                   help="default: torch native and XLA; triton: the bridge's Triton kernels "
                        "on both sides")
    p.add_argument("--round-trip", type=int, default=0, metavar="N",
                   help="also save both sides after step N and continue each in the other "
                        "framework to the end (model and optimizer state)")
    p.add_argument("--out", default=DEFAULT_OUT, help="folder of the JSON logs and the plot")
    p.add_argument("--md", help="markdown to refresh (default: BENCHMARKS.md at the repository "
                                "root for the default --out, else OUT/BENCHMARKS.md)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--render", action="store_true",
                   help="train nothing: redraw the plot and the section from OUT's JSON logs")
    x = p.add_argument_group("model, data and experiments")
    x.add_argument("--layers", type=int, default=Settings.layers)
    x.add_argument("--hidden", type=int, default=Settings.hidden)
    x.add_argument("--heads", type=int, default=Settings.heads)
    x.add_argument("--batch", type=int, default=Settings.batch)
    x.add_argument("--seq", type=int, default=Settings.seq)
    x.add_argument("--seed", type=int, default=Settings.seed)
    x.add_argument("--lr", type=float, default=Settings.lr, help="peak learning rate")
    x.add_argument("--sides", help="instead of --platform: two sides FRAMEWORK:PLATFORM,... "
                                   "(e.g. torch:torch,torch:triton)")
    x.add_argument("--perturb", type=float, default=0.0, metavar="EPS",
                   help="the second side starts from the weights times 1 + EPS * N(0, 1)")
    x.add_argument("--probe", type=int, nargs="+", default=(), metavar="STEP",
                   help="before these steps, each framework's gradients at both sides' "
                        "weights: the frameworks' arithmetic against the weights' drift")
    x.add_argument("--tag", help="the log's name, OUT/<tag>.json (default "
                                 "training_<platform>_<dtype>[_lr<lr>]); the plot and the "
                                 "section draw every OUT/training_*.json")
    args = p.parse_args(argv)
    if args.sides:
        sides = tuple(args.sides.split(","))
        ok = len(sides) == 2 and all(
            s.split(":")[0] in ("torch", "jax") and len(s.split(":")) == 2 for s in sides)
        if not ok:
            p.error(f"--sides: expected two FRAMEWORK:PLATFORM (torch or jax), got {args.sides}")
    if (args.sides or args.perturb) and not args.tag:
        p.error("--sides / --perturb: name the experiment's log with --tag (training_<name> "
                "to have it drawn and tabled with the standard runs)")
    if args.round_trip and (args.sides and sides[0][:3] == sides[1][:3]):
        p.error("--round-trip: the two sides must be different frameworks")
    return p, args


def main(argv=None):
    p, args = parse(sys.argv[1:] if argv is None else list(argv))
    md = args.md or (os.path.join(ROOT, "BENCHMARKS.md")
                     if os.path.abspath(args.out) == DEFAULT_OUT else
                     os.path.join(args.out, "BENCHMARKS.md"))
    if args.render:
        return report.refresh(args.out, md, plot_it=not args.no_plot, log=print)
    steps = args.steps or (20 if args.platform == "triton" else 200)
    s = Settings(steps=steps, dtype=args.dtype,
                 sides=tuple(args.sides.split(",")) if args.sides else PLATFORMS[args.platform],
                 layers=args.layers, hidden=args.hidden, heads=args.heads, batch=args.batch,
                 seq=args.seq, seed=args.seed, lr=args.lr, perturb=args.perturb,
                 round_trip=args.round_trip, probe=tuple(args.probe))
    if s.steps < 2:
        p.error(f"--steps: expected at least 2 (a warmup step and one more), got {s.steps}")
    if not all(1 <= x <= s.steps for x in s.probe):
        p.error(f"--probe: expected steps in 1..{s.steps}, got {list(s.probe)}")
    if not 0 <= s.round_trip < s.steps:
        p.error(f"--round-trip: expected 0 <= N < steps ({s.steps}), got {s.round_trip}")
    print(f"training {' vs '.join(s.sides)}, {s.dtype}, {s.steps} steps, "
          f"{s.layers} layers x {s.hidden}, batch {s.batch} x {s.seq} bytes",
          file=sys.stderr, flush=True)
    record = run(s, progress=lambda r: print(_line(r), file=sys.stderr, flush=True))
    tag = args.tag or f"training_{args.platform}_{args.dtype}" + (
        "" if s.lr == Settings.lr else f"_lr{s.lr:g}")
    path = report.write(record, args.out, tag)
    print(report.summary(record))
    print(f"log: {path}")
    report.refresh(args.out, md, plot_it=not args.no_plot, log=print)
    t = record["targets"]
    return 0 if t.get("first_ok", True) and t.get("last_ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())
