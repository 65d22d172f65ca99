"""The training comparison's outputs: the JSON log of a run, the plot (OUT/training.png)
and BENCHMARKS.md's "Training parity" section, both drawn from every
OUT/training_*.json (the standard runs first: training_default_fp32,
training_triton_fp32, training_default_bf16; then the experiments by name)."""

import glob
import io
import json
import os

from ..sections import replace_section
from .optim import Hyper

HEADING = "## Training parity"
PLOT = "training.png"
STANDARD = ("training_default_fp32", "training_triton_fp32", "training_default_bf16")
SIDES = {"torch:torch": "torch native", "jax:xla": "JAX XLA", "torch:triton": "torch Triton",
         "jax:triton": "JAX Triton"}
NAMES = {"torch": "torch", "jax": "JAX"}
FLOOR = 1e-8  # the plot's floor: equal losses have no logarithm


def write(record: dict, out: str, tag: str) -> str:
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, tag + ".json")
    with open(path, "w") as f:
        json.dump(record, f, separators=(",", ":"))
    return path


def load(out: str) -> dict:
    """{tag: record} of OUT/training_*.json, the standard runs first."""
    found = {}
    for path in sorted(glob.glob(os.path.join(out, "training_*.json"))):
        with open(path) as f:
            found[os.path.basename(path)[:-5]] = json.load(f)
    order = [t for t in STANDARD if t in found] + sorted(t for t in found if t not in STANDARD)
    return {t: found[t] for t in order}


def label(record: dict) -> str:
    """What a run compares, from its settings."""
    s = record["settings"]
    text = " vs ".join(SIDES.get(x, x) for x in s["sides"])
    if s["perturb"]:
        text += f", weights {s['perturb']:g} apart at the start"
    text = f"{s['dtype']}, {text}"
    if record["hyper"]["lr"] != Hyper.lr:
        text += f", lr {record['hyper']['lr']:g}"
    return text


def _direction(record, key):
    a, b = (NAMES[x.split(":")[0]] for x in record["settings"]["sides"])
    return f"{a} -> {b}" if key == "a->b" else f"{b} -> {a}"


def _verdict(ok):
    return "" if ok is None else (" met" if ok else " **NOT met**")


def summary(record: dict) -> str:
    """A few lines: the targets, where the curves part, the round trip."""
    t, s = record["targets"], record["settings"]
    lines = [f"{label(record)}, {s['steps']} steps ({record['wall_s']:.0f} s):",
             f"  steps 1-{t['first_steps']}: largest loss difference {t['first_worst']:.1e}"
             f" (target 1e-5){_verdict(t.get('first_ok'))}",
             f"  step {t['last_step']}: loss difference {t['last']:.1e} (target 1e-3)"
             f"{_verdict(t.get('last_ok'))}"]
    for key, name in (("loss_rel", "losses"), ("grad_rel", "gradients"),
                      ("weight_rel", "weights")):
        cross = ", ".join(f"{tol} at step {st}" for tol, st in t["crossings"][key].items()
                          if st is not None)
        lines.append(f"  {name} first differ by more than: {cross or 'never past 1e-5'}")
    for pr in record.get("probes") or ():
        (fn, fr), (wn, wr) = pr["frameworks"], pr["weights"]
        lines.append(f"  probe before step {pr['step']}: gradients differ {fr:.1e} between the "
                     f"frameworks at the same weights ({fn}), {wr:.1e} between the two sides' "
                     f"weights in one framework ({wn})")
    for key, rt in (record.get("round_trip") or {}).items():
        lines.append(
            f"  round trip {_direction(record, key)} after step {rt['at']}: resumed losses vs "
            f"the run saved / the run loaded: first 20 steps {rt['vs_saved_first20']:.1e} / "
            f"{rt['vs_loaded_first20']:.1e}, last step {rt['vs_saved_last']:.1e} / "
            f"{rt['vs_loaded_last']:.1e}")
    return "\n".join(lines).replace("**", "")


def plot(records: dict, path: str) -> bool:
    """Three panels: the loss against step (torch solid, the other side dashed), the
    relative loss difference and the weights' (log axes). False when matplotlib is
    missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2))
    for i, (tag, rec) in enumerate(records.items()):
        color, rows = f"C{i}", rec["rows"]
        steps = [r["step"] for r in rows]
        if not rec["settings"]["perturb"]:
            axes[0].plot(steps, [r["loss"][0] for r in rows], color=color, lw=1)
            axes[0].plot(steps, [r["loss"][1] for r in rows], color=color, lw=1, ls="--")
        axes[1].semilogy(steps, [max(r["loss_rel"], FLOOR) for r in rows], color=color, lw=0.7,
                         label=label(rec))
        axes[2].semilogy(steps, [max(r["weight_rel"], FLOOR) for r in rows], color=color, lw=1)
    for tol in (1e-5, 1e-3):
        axes[1].axhline(tol, color="black", lw=0.6, ls=":")
    axes[0].set(xlabel="step", ylabel="loss (nats/byte)",
                title="loss: torch solid, JAX dashed")
    axes[1].set(xlabel="step", ylim=(FLOOR, 1),
                title=f"loss: |b - a| / |a| (floor {FLOOR:g}; targets dotted)")
    axes[2].set(xlabel="step", ylim=(FLOOR, 1), title="weights: worst ||b - a|| / ||a||")
    fig.legend(*axes[1].get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=8,
               frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    buf = io.BytesIO()
    fig.savefig(buf, dpi=64)
    plt.close(fig)
    from PIL import Image  # matplotlib's own dependency

    # a 64-colour palette: a third of the bytes of the RGBA image, the same picture
    Image.open(buf).convert("RGB").quantize(64).save(path, optimize=True)
    return True


def section(records: dict, image: str = None) -> str:
    """BENCHMARKS.md's section (heading included) for `records` ({tag: record})."""
    lines = [HEADING, ""]
    if not records:
        return "\n".join(lines + ["Not run yet (`python -m parity.train`).", ""])
    rec = next(iter(records.values()))
    s, h, corpus = rec["settings"], rec["hyper"], rec["corpus"]
    lines += [
        f"`python -m parity.train` (`--platform triton --steps 20`, `--dtype bf16`): a GLA "
        f"language model ({s['layers']} layers, hidden {s['hidden']}, {s['heads']} heads, "
        f"bytes as tokens) initialised once in NumPy and trained from those weights in "
        f"PyTorch (`torch_side.models`, `torch.optim.AdamW`) and in JAX (`jax_side.models`, "
        f"`optax.adamw`) on the same batches ({s['batch']} x {s['seq']} bytes a step of "
        f"`{corpus['file']}`, {corpus['bytes']} bytes, in an order drawn from seed "
        f"{s['seed']}). AdamW b1 {h['b1']}, b2 {h['b2']}, eps {h['eps']:g}, weight decay "
        f"{h['weight_decay']} on the matrices but the embedding, gradients clipped to global "
        f"norm {h['clip']}, learning rate {h['lr']:g} (unless the row says otherwise) after "
        f"{h['warmup']} warmup steps (a fifth of a shorter run), then a cosine down to a "
        f"tenth at the run's last step. Each framework keeps its own weights (nothing is "
        f"re-synchronised). Losses compared as |b - a| / |a| (a: the first side, torch), "
        f"gradients (before clipping) and weights as the worst parameter's "
        f"||b - a|| / ||a||. Time: wall clock on this shared 2-core machine, which other "
        f"work loads unevenly.", ""]
    if image:
        lines += [f"![training parity]({image})", ""]
    lines += ["| run | steps | loss at the end (a / b) | steps 1-20: largest loss difference "
              "(target 1e-5) | last step: loss difference (target 1e-3) | first step past "
              "1e-5 / 1e-3: losses | gradients | weights | time |",
              "|---|---|---|---|---|---|---|---|---|"]
    for rec in records.values():
        t, rows, s = rec["targets"], rec["rows"], rec["settings"]

        def cross(key):
            x = t["crossings"][key]
            return f"{x['1e-05'] or '-'} / {x['1e-03'] or '-'}"

        lines.append(
            f"| {label(rec)} | {s['steps']} | {rows[-1]['loss'][0]:.4f} / "
            f"{rows[-1]['loss'][1]:.4f} | {t['first_worst']:.1e}{_verdict(t.get('first_ok'))}"
            f" | {t['last']:.1e}{_verdict(t.get('last_ok'))} | {cross('loss_rel')} | "
            f"{cross('grad_rel')} | {cross('weight_rel')} | {rec['wall_s']:.0f} s |")
    probed = [(rec, pr) for rec in records.values() for pr in rec.get("probes") or ()]
    if probed:
        lines += ["", "Where the difference comes from (`--probe STEP ...`): before a step, "
                  "each framework's gradients at each side's weights. The frameworks at the "
                  "same weights differ by their arithmetic alone (reduction order, the chunked "
                  "algorithms); one framework at the two sides' weights shows what the "
                  "weights' difference so far does to the gradients. Worst parameter's "
                  "relative difference:", "",
                  "| run | before step | weights apart | frameworks, same weights | one "
                  "framework, the two sides' weights |", "|---|---|---|---|---|"]
        for rec, pr in probed:
            rows = rec["rows"]
            apart = rows[pr["step"] - 2]["weight_rel"] if pr["step"] > 1 else 0.0
            (fn, fr), (wn, wr) = pr["frameworks"], pr["weights"]
            lines.append(f"| {label(rec)} | {pr['step']} | {apart:.1e} | {fr:.1e} (`{fn}`) | "
                         f"{wr:.1e} (`{wn}`) |")
    trips = [(rec, k, v) for rec in records.values()
             for k, v in (rec.get("round_trip") or {}).items()]
    if trips:
        lines += ["", "Checkpoint round trip: after the step shown, each side saves its model "
                  "(`save_pretrained`) and AdamW state (`optimizer.safetensors`); the other "
                  "framework loads them and trains on to the end. Relative loss differences "
                  "of the resumed run from the uninterrupted runs: the run saved is the "
                  "trajectory it continues; the run loaded (the loading framework's own) had "
                  "parted from it before the save:", "",
                  "| run | direction | after step | vs the run saved: first 20 steps / last "
                  "step | vs the run loaded: first 20 steps / last step |",
                  "|---|---|---|---|---|"]
        for rec, key, v in trips:
            lines.append(f"| {label(rec)} | {_direction(rec, key)} | {v['at']} | "
                         f"{v['vs_saved_first20']:.1e} / {v['vs_saved_last']:.1e} | "
                         f"{v['vs_loaded_first20']:.1e} / {v['vs_loaded_last']:.1e} |")
    return "\n".join(lines + [""])


def splice(text: str, new: str) -> str:
    """`text` with its training section replaced by `new` (the section, heading first),
    or `new` appended (parity.sections)."""
    return replace_section(text, new.split("\n", 1)[1].strip("\n"), HEADING)


def refresh(out: str, md: str, *, plot_it: bool = True, log=print) -> int:
    """Redraw OUT/training.png and the section of `md` from OUT's logs."""
    records = load(out)
    image = None
    if plot_it and records:
        png = os.path.join(out, PLOT)
        if plot(records, png):
            image = os.path.relpath(png, os.path.dirname(os.path.abspath(md)))
            log(f"plot: {png}")
        else:
            log("no plot: matplotlib is not installed (pip install 'gla-bridge[bench]')")
    text = open(md).read() if os.path.exists(md) else ""
    with open(md, "w") as f:
        f.write(splice(text, section(records, image)))
    log(f"section: {md} ({', '.join(records) or 'no runs'})")
    return 0
