"""`python -m parity`: prove that every backend on this machine computes the same function.

Each case is generated once in NumPy from a seed, rounded to the tested dtype,
and handed to every backend; outputs, final states and every gradient are
compared with the float64 oracle and pairwise across backends. Prints a table
(case x backend: largest relative error, pass/fail) and exits 1 on any
mismatch, 2 on a usage error.
"""

import argparse
import json
import sys
import time

from . import backends as backends_mod
from . import cases as cases_mod
from . import compare
from .compare import tolerance

def matrix(full: bool):
    """(case, dtype) pairs: every SPEC feature in fp32, low precision on a few."""
    out = [(c, "float32") for c in cases_mod.FEATURES]
    low = [c for c in cases_mod.FEATURES if c.name in ("everything", "gqa", "strong-gates")]
    out += [(c, d) for c in low for d in ("bfloat16", "float16")]
    if full:
        out += [(c.with_(name=c.name + "-long", T=64, seqlens=c.seqlens and
                         tuple(3 * s + 5 for s in c.seqlens)), "float32")
                for c in cases_mod.FEATURES]
        out += [(c, d) for c in cases_mod.FEATURES for d in ("bfloat16", "float16")
                if c not in low]
    return out


def run(backends, pairs, seed=0, progress=None):
    """Run every backend on every (case, dtype); returns a list of result rows.

    A row: case, dtype, backend, against ("oracle" or another backend), errors
    {quantity: relative error}, worst, tol, ok, and error (an exception's text)."""
    rows = []
    ref = backends[0]
    for i, (case, dtype) in enumerate(pairs):
        arrays = backends_mod.prepared(case, dtype, seed)
        results = {}
        for b in backends:
            t0 = time.time()
            try:
                results[b.name] = b.run(case, arrays, dtype)
                err = None
            except Exception as e:  # a failing backend is a mismatch, not a crash
                err = f"{type(e).__name__}: {e}"
            if progress:
                progress(f"[{i + 1}/{len(pairs)}] {case.name} {dtype} {b.name}: "
                         f"{'error' if err else 'done'} in {time.time() - t0:.1f}s")
            if b is ref:
                if err:
                    raise RuntimeError(f"the oracle failed on {case.name}: {err}")
                continue
            rows.append(_row(case, dtype, b.name, ref.name, results, err, tolerance(dtype)))
        names = [b.name for b in backends[1:] if b.name in results]
        for j, a in enumerate(names):
            for b in names[j + 1:]:
                # Backends must agree with each other as tightly as each agrees
                # with the oracle (a looser pair bound could never catch anything).
                rows.append(_row(case, dtype, a, b, results, None, tolerance(dtype)))
    return rows


def _row(case, dtype, name, against, results, error, tol):
    errors = {} if error else compare.errors(results[name], results[against],
                                              case.gate_grad_floor)
    worst = max(errors.values(), default=float("inf"))
    return dict(case=case.name, dtype=dtype, backend=name, against=against, errors=errors,
                worst=worst, tol=tol, ok=error is None and worst <= tol, error=error)


def _cell(r) -> str:
    if r is None:
        return f"{'-':>24}"
    value = "error" if r["error"] else f"{r['worst']:.1e}"
    return f"{value:>17} {'ok' if r['ok'] else 'FAIL':>6}"


def table(rows) -> str:
    """Case x backend grid of the worst relative error against the oracle, then
    the pairwise agreement and any failures spelled out."""
    vs_oracle = [r for r in rows if r["against"] == "oracle"]
    cols = list(dict.fromkeys(r["backend"] for r in vs_oracle))
    keys = list(dict.fromkeys((r["case"], r["dtype"]) for r in vs_oracle))
    cell = {(r["case"], r["dtype"], r["backend"]): r for r in vs_oracle}
    width = max([len(f"{c} {d}") for c, d in keys] + [4])
    lines = ["vs the float64 oracle (largest relative error over o, final_state, gradients):",
             f"{'case':<{width}}  " + "  ".join(f"{c:>24}" for c in cols)]
    for c, d in keys:
        parts = [_cell(cell.get((c, d, b))) for b in cols]
        lines.append(f"{c + ' ' + d:<{width}}  " + "  ".join(parts))
    pairs = [r for r in rows if r["against"] != "oracle"]
    if pairs:
        lines.append("pairwise:")
        for (a, b) in dict.fromkeys((r["backend"], r["against"]) for r in pairs):
            sel = [r for r in pairs if (r["backend"], r["against"]) == (a, b)]
            worst = max(r["worst"] for r in sel)
            ok = all(r["ok"] for r in sel)
            lines.append(f"  {a} vs {b}: {len(sel)} cases, worst {worst:.1e} "
                         f"{'ok' if ok else 'FAIL'}")
    bad = [r for r in rows if not r["ok"]]
    for r in bad:
        detail = r["error"] or ", ".join(f"{k}={v:.1e}" for k, v in r["errors"].items()
                                         if not v <= r["tol"])
        lines.append(f"MISMATCH {r['case']} {r['dtype']} {r['backend']} vs {r['against']} "
                     f"(tol {r['tol']:.0e}): {detail}")
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--train" in argv:  # the training comparison has its own options (parity/train)
        from .train.__main__ import main as train

        return train([a for a in argv if a != "--train"])
    ap = argparse.ArgumentParser(prog="python -m parity", description=__doc__.splitlines()[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="the small matrix (default)")
    size.add_argument("--full", action="store_true", help="longer sequences, every dtype")
    ap.add_argument("--backends", help="comma-separated backend names (default: all available)")
    ap.add_argument("--cases", help="comma-separated case names (default: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH", help="write every number here")
    ap.add_argument("--multi-device", type=int, metavar="P", nargs="?", const=2,
                    help="instead: context parallelism over P (default 2) gloo ranks (torch) "
                         "and P host devices (JAX) on the same inputs, against the oracle "
                         "and each other")
    ap.add_argument("--model", action="store_true",
                    help="instead: a small random-weight GLA language model in every "
                         "framework and backend against its float64 model (logits, greedy "
                         "tokens); --backends picks among " + ", ".join(_model_backends()))
    args = ap.parse_args(argv)
    if args.multi_device is not None:
        return _multi_device(ap, args)
    if args.model:
        return _model(ap, args)

    every = backends_mod.all_backends()
    known = {b.name for b in every}
    wanted = set(args.backends.split(",")) if args.backends else None
    if wanted and not wanted <= known:
        ap.error(f"unknown backend(s) {sorted(wanted - known)}; known: {sorted(known)}")
    chosen = []
    for b in every:
        if wanted and b.name not in wanted and b.name != "oracle":
            continue
        reason = b.unavailable()
        if reason:
            print(f"skip {b.name}: {reason}", file=sys.stderr)
        else:
            chosen.append(b)
    pairs = matrix(args.full)
    if args.cases:
        names = set(args.cases.split(","))
        unknown = names - {c.name for c, _ in pairs}
        if unknown:
            ap.error(f"unknown case(s) {sorted(unknown)}")
        pairs = [(c, d) for c, d in pairs if c.name in names]
    if len(chosen) < 2:
        print("only the oracle is available: nothing to compare", file=sys.stderr)
    print(f"backends: {', '.join(b.name for b in chosen)}; {len(pairs)} cases, "
          f"seed {args.seed}", file=sys.stderr)
    rows = run(chosen, pairs, seed=args.seed,
               progress=lambda m: print(m, file=sys.stderr, flush=True))
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(seed=args.seed, backends=[b.name for b in chosen], rows=rows), f,
                      indent=1, default=str)
    failed = sum(not r["ok"] for r in rows)
    print(f"parity: {len(rows) - failed} passed, {failed} failed")
    return 1 if failed else 0


def _multi_device(ap, args):
    from . import multi_device

    if args.multi_device < 2:
        ap.error(f"--multi-device: expected P >= 2, got {args.multi_device}")
    names = set(args.cases.split(",")) if args.cases else None
    if names and not names <= {c.name for c in multi_device.CASES}:
        ap.error(f"unknown case(s) {sorted(names - {c.name for c in multi_device.CASES})}; "
                 f"known: {[c.name for c in multi_device.CASES]}")
    rows = multi_device.compare(args.multi_device, args.seed, names)
    failed = sum(not ok for *_, ok in rows)
    print(f"parity --multi-device: {len(rows) - failed} passed, {failed} failed")
    return 1 if failed else 0


def _model_backends():
    from .models import BACKENDS

    return BACKENDS


def _model(ap, args):
    from . import models

    wanted = args.backends.split(",") if args.backends else None
    if wanted and not set(wanted) <= set(models.BACKENDS):
        ap.error(f"unknown backend(s) {sorted(set(wanted) - set(models.BACKENDS))}; "
                 f"known: {list(models.BACKENDS)}")
    if args.cases and not set(args.cases.split(",")) <= set(models.CONFIGS):
        ap.error(f"unknown case(s) {sorted(set(args.cases.split(',')) - set(models.CONFIGS))}; "
                 f"known: {list(models.CONFIGS)}")
    chosen = []
    for name in wanted or models.BACKENDS:
        b = models.ModelBackend(name)
        reason = b.unavailable()
        if reason:
            print(f"skip {name}: {reason}", file=sys.stderr)
        elif b.interpreted and not wanted:
            print(f"skip {name}: interpreted on this machine (slow); name it in --backends "
                  f"to run it", file=sys.stderr)
        else:
            chosen.append(b)
    configs = args.cases.split(",") if args.cases else tuple(models.CONFIGS)
    rows = models.compare(chosen, configs, seed=args.seed,
                          progress=lambda m: print(m, file=sys.stderr, flush=True))
    print(models.table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(seed=args.seed, rows=rows), f, indent=1, default=str)
    failed = sum(not r["ok"] for r in rows)
    print(f"parity --model: {len(rows) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
