"""The GPU section's parts on fla's tuning, per-kernel device times and the config
sweep (parity/gpu/ahead.py, kernels.py, sweep.py), rendered from the kit's JSON."""


def _us(x):
    return "-" if x is None else f"{x:.1f}" if x < 100 else f"{x:.0f}"


def _knobs(k):
    return ", ".join(f"{n}={v}" for n, v in sorted(k.items()))


def _config(x) -> str:
    ran, mod = x.get("config"), x.get("model_config")
    if not ran:
        return "-"
    text = f"{ran[0]}, {ran[1]}"
    return text if not mod or mod == ran else f"{text} (model: {mod[0]}, {mod[1]})"


def tune_line(r) -> str:
    """One line on fla's autotuning: tuned here (and its cold time), or loaded."""
    if not r:
        return ""
    if r.get("skipped"):
        return f"fla not tuned ({r['skipped']})"
    ahead = r.get("compile_ahead") or {}
    done = sum(o["status"] == "ok" for o in ahead.values())
    workers = (f"; {done} of {len(ahead)} compile-ahead workers (ours, fla's configs) "
               f"finished" if ahead else "")
    if r.get("tuned"):
        return (f"tuned in this run, {r.get('winners', 0)} winners written to fla-configs.json; "
                f"fla's cold start {r.get('fla_cold_s', '-')} s (its configs compiled by "
                f"parallel workers in {r.get('fla_compile_s', 0):.0f} s, then tuned alone on "
                f"the device in {r.get('tune_s', 0):.0f} s; ours needs no tuning)" + workers)
    if r.get("source"):
        return (f"winners loaded from {r['source']} ({r.get('winners', 0)}): nothing tuned"
                + workers)
    return "not run" + workers


def _kernel_tables(st) -> list:
    r, rows = st["result"], st["rows"]
    kern = [x for x in rows if x.get("kind") == "kernel"]
    out = [f"One forward+backward at T={r.get('T')}, each kernel's device time "
           "(`torch.profiler`, CUDA activity), beside the instruction model's prediction for "
           f"{r.get('target')} from {r.get('model_source')}: dynamic warp-instructions, "
           "registers, CTAs per SM, the most bar.sync in a loop body.", ""]
    bad = [x for x in rows if x.get("kind") == "profile" and x.get("status") != "ok"]
    out += [f"- {x['impl']}: {x['status']}: {x['error']}" for x in bad] + ([""] if bad else [])
    ours = [x for x in kern if x["impl"].startswith("ours")]
    if ours:
        out += ["| implementation | phase | stage | kernel | grid | warps, stages | device us | "
                "time model us (error) | model G warp-instr | regs | CTAs/SM | bar.sync/loop |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for x in ours:
            dyn, mus = x.get("model_dynamic"), x.get("model_us")
            err = f" ({(mus - x['us']) / x['us']:+.0%})" if mus and x["us"] else ""
            out.append(f"| {x['impl']} | {x['phase']} | {x['stage']} | {x['kernel'][:60]} | "
                       f"{tuple(x['grid']) if x.get('grid') else '-'} | {_config(x)} | "
                       f"{_us(x['us'])} | {_us(mus)}{err} | "
                       f"{'-' if not dyn else f'{dyn / 1e9:.3f}'} | "
                       f"{x.get('model_regs', '-')} | {x.get('model_ctas_per_sm', '-')} | "
                       f"{x.get('model_bars', '-')} |")
        out += ["", "(warps, stages: as launched; \"model: ...\" where the model's report "
                "compiled another config, a tuned launch: its figures are the default's.)", ""]
    err = r.get("model_error") or {}
    if err:
        out += [f"The time model ({r.get('time_model')}, parity/compiled/timemodel.py) against "
                "the device times, summed over the kernels it has: " + "; ".join(
                    f"{n}: {v:+.0%}" for n, v in err.items()) + ".", ""]
    rho = r.get("rank_correlation") or {}
    if rho:
        out += ["How well the instruction model ranks our kernels (Spearman's rank correlation "
                "of predicted dynamic warp-instructions and measured device time; 1: the same "
                "order): " + "; ".join(f"{n}: {'-' if v is None else f'{v:.2f}'}"
                                       for n, v in rho.items()) + ".", ""]
    theirs = [x for x in kern if not x["impl"].startswith("ours")]
    if theirs:
        agg = {}
        for x in theirs:
            a = agg.setdefault((x["impl"], x["phase"], x["stage"], x["kernel"]), [0, 0.0])
            a[0] += 1
            a[1] += x["us"]
        out += ["| implementation | phase | stage | kernel | launches | device us |",
                "|---|---|---|---|---|---|"]
        out += [f"| {i} | {p} | {s} | {k[:60]} | {n} | {_us(us)} |"
                for (i, p, s, k), (n, us) in agg.items()]
        out.append("")
    stages = r.get("stages") or {}
    ours_c = next((n for n in stages if n.startswith("ours chunk")), None)
    fla = next((n for n in stages if "fla" in n), None)
    if ours_c:
        keys = list(dict.fromkeys(list(stages[ours_c]) + list(stages.get(fla) or {})))
        out += [f"Stage by stage, device us: {ours_c} against {fla or 'fla (not profiled)'}:",
                "", "| phase/stage | ours | fla | fla / ours |", "|---|---|---|---|"]
        for k in keys:
            a, b = stages[ours_c].get(k), (stages.get(fla) or {}).get(k)
            out.append(f"| {k} | {_us(a)} | {_us(b)} | "
                       f"{f'{b / a:.2f}x' if a and b else '-'} |")
        out.append("")
    return out or ["not measured in this run.", ""]


def _sweep_table(st) -> list:
    r, rows = st["result"], st["rows"]
    cands = [x for x in rows if x.get("kind") == "candidate"]
    if not cands:
        return ["not measured in this run.", ""]
    by = {s: sum(x.get("status") == s for x in cands) for s in ("ok", "error", "not_reached")}
    out = [f"Each launch site's candidates (bridge/tuning.py `candidates`: warps, stages, tiles "
           f"that fit) at (B,T,H,K,V) = {tuple(r.get('shape') or ())}, {r.get('dtype')}, on "
           f"{r.get('device')}: {len(cands)} candidates, {by['ok']} timed, {by['error']} "
           f"failed, {by['not_reached']} not reached. Each sums the device times of the "
           f"launches its knobs change; a winner must beat the defaults by "
           f"{100 * (r.get('margin') or 0):.0f}%. Winners that do: {r.get('entries', 0)}, "
           f"written as the device table {r.get('table')} (`python -m bridge.tuning --merge` "
           "ships it).", "",
           "| gates | family | site | chosen | us | defaults | defaults us | defaults / chosen "
           "| candidates |", "|---|---|---|---|---|---|---|---|---|"]
    for w in r.get("winners") or ():
        out.append(f"| {w['gates']} | {w['family']} | {w['site']} | {_knobs(w['knobs'])} | "
                   f"{_us(w['us'])} | {_knobs(w['default'])} | {_us(w['default_us'])} | "
                   f"{w['default_us'] / w['us']:.2f}x | {w['candidates']} |" if w["us"] else
                   f"| {w['gates']} | {w['family']} | {w['site']} | - | - | - | - | - | - |")
    failed = [x for x in cands if x.get("status") == "error"]
    if failed:
        out += ["", "Candidates that failed (dropped):", ""]
        out += [f"- {x['gates']} {x['family']} {x['site']} {_knobs(x['knobs'])}: {x['error']}"
                for x in failed[:20]]
    return out + [""]


def markdown(result, step) -> list:
    """The kernels and sweep parts of the GPU section (`step(result, name)` a step)."""
    return (["### Per-kernel device times", ""] + _kernel_tables(step(result, "kernels"))
            + ["### Launch-config sweep", ""] + _sweep_table(step(result, "sweep")))
