"""The kit's JSON (`gpu.json`) read back: its schema, BENCHMARKS.md's GPU section, the
short table printed last, and the section's place in BENCHMARKS.md and results.json.

Schema "gla-bridge/gpu-kit/2": {schema, kit (full | quick | dry-run), command, date,
commit, budget_s, wall_s, stand_ins [str], steps [{name, status (ok | error | timed_out
| skipped), cap_s, estimate_s, wall_s, error, result {}, rows []}], kernels, sweep,
ranking}, the steps in plan.STEPS order; "kernels" and "sweep" repeat those steps'
{status, result, rows}; "ranking" is what parity/gpu/ranking.py added to tuning.json
({device, entries, ms}, or {error}; absent in JSONs from before it). Rows carry a "kind"
("test", "row", "launch", "agree", "call", "profile", "kernel", "candidate"); measured
ones a status (parity/gpu/rows.py)."""

import json

from .. import sections
from . import render_kernels
from .plan import STEPS
from .rows import STATUSES as ROW_STATUSES

SCHEMA = "gla-bridge/gpu-kit/2"
SECTIONS = ("kernels", "sweep")
MEASURED = ("row", "launch", "call", "profile", "candidate")
STATUSES = ("ok", "error", "timed_out", "skipped")
TOP = {"schema": str, "kit": str, "command": str, "date": str, "commit": str,
       "budget_s": (int, float), "wall_s": (int, float), "stand_ins": list, "steps": list,
       "kernels": dict, "sweep": dict}
STEP = {"name": str, "status": str, "cap_s": (int, float), "estimate_s": (int, float),
        "wall_s": (int, float), "result": dict, "rows": list}


def validate(result) -> None:
    """ValueError listing every way `result` departs from the schema (module doc)."""
    bad = []
    for key, types in TOP.items():
        if not isinstance(result.get(key), types):
            bad.append(f"{key}: expected {types}, got {type(result.get(key)).__name__}")
    if result.get("schema") != SCHEMA:
        bad.append(f"schema: expected {SCHEMA!r}, got {result.get('schema')!r}")
    steps = result.get("steps") or []
    if [s.get("name") for s in steps] != list(STEPS):
        bad.append(f"steps: expected {list(STEPS)} in order, got {[s.get('name') for s in steps]}")
    for s in steps:
        for key, types in STEP.items():
            if not isinstance(s.get(key), types):
                bad.append(f"steps[{s.get('name')}].{key}: expected {types}, "
                           f"got {type(s.get(key)).__name__}")
        if s.get("status") not in STATUSES:
            bad.append(f"steps[{s.get('name')}].status: {s.get('status')!r}")
        if s.get("status") != "ok" and not s.get("error"):
            bad.append(f"steps[{s.get('name')}]: status {s.get('status')} without an error")
        for r in s.get("rows") or ():
            if r.get("kind") in MEASURED and r.get("status") not in ROW_STATUSES:
                bad.append(f"steps[{s.get('name')}]: a {r.get('kind')} row with status "
                           f"{r.get('status')!r}")
                break
    if bad:
        raise ValueError("gpu kit JSON: " + "; ".join(bad))


def load(path) -> dict:
    with open(path) as f:
        result = json.load(f)
    validate(result)
    return result


def _step(result, name):
    return next((s for s in result["steps"] if s["name"] == name), {"result": {}, "rows": []})


def _rows(result, name, kind="row"):
    return [r for r in _step(result, name)["rows"] if r.get("kind") == kind]


def _ms(x):
    return "-" if x is None else f"{x:.3f}" if x < 10 else f"{x:.2f}"


def _cell(row):
    """A row's milliseconds, or its status where it has none."""
    if not row:
        return "-"
    return _ms(row.get("ms")) if row.get("status", "ok") == "ok" else row["status"]


def _ratio(a, b):
    return "-" if not a or not b else f"{a / b:.2f}x"


def summary(step) -> str:
    """One line on what a step found."""
    r, rows = step.get("result") or {}, step.get("rows") or []
    name = step["name"]
    if name == "machine" and r.get("device"):
        return (f"{r['device']}; {r.get('matmul_dtype')} matmul {r.get('matmul_tflops', 0):.3g} "
                f"TFLOP/s, copy {r.get('copy_gbps', 0):.3g} GB/s")
    if name == "correctness":
        c = r.get("counts")
        if c:
            return f"{c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped"
    if name in ("speed", "varlen", "decode", "kernels", "sweep"):
        got = [x for x in rows if x.get("kind") in MEASURED]
        by = {st: sum(x.get("status") == st for x in got) for st in ROW_STATUSES}
        return f"{by['ok']} of {len(got)} rows ok" + "".join(
            f", {n} {st}" for st, n in by.items() if n and st != "ok")
    if name == "tune":
        return render_kernels.tune_line(r)
    return ""


def _speed_tables(result):
    rows = _rows(result, "speed")
    if not rows:
        return ["not measured in this run."]
    out = []
    Ts = sorted({r["T"] for r in rows})
    for mode, title in (("fwd", "Forward"), ("fwdbwd", "Forward + backward")):
        by = {(r["impl"], r["T"]): r for r in rows if r.get("mode") == mode}
        ok = {k: r for k, r in by.items() if r.get("status", "ok") == "ok"}
        impls = list(dict.fromkeys(r["impl"] for r in rows if r.get("launch") in ("torch", "jax")))
        chunk = [i for i in impls if "chunk" in i]
        fused = [i for i in impls if "fused" in i]
        cols = chunk + fused
        out += [f"{title}, ms (median; fla / ours: fla's time over ours, above 1 where ours "
                "is faster):", "",
                "| T | " + " | ".join(cols) + " | chunk: fla / ours | fused: fla / ours |",
                "|---|" + "---|" * (len(cols) + 2)]
        for T in Ts:
            cell = lambda i: ok.get((i, T), {}).get("ms")  # noqa: E731
            ours_c = cell(next((i for i in chunk if i.startswith("ours") and "torch" in i), ""))
            fla_c = cell(next((i for i in chunk if "fla" in i), ""))
            ours_f = cell(next((i for i in fused if i.startswith("ours") and "torch" in i), ""))
            fla_f = cell(next((i for i in fused if "fla" in i), ""))
            out.append(f"| {T} | " + " | ".join(_cell(by.get((i, T))) for i in cols)
                       + f" | {_ratio(fla_c, ours_c)} | {_ratio(fla_f, ours_f)} |")
        out.append("")
    errors = [r for r in rows if r.get("status", "ok") != "ok"]
    if errors:
        out += ["Not timed (each on its own row; the others measured):", ""]
        out += [f"- {r['impl']}, T={r['T']}, {r.get('mode')}: {r['status']}: {r['error']}"
                for r in errors]
        out.append("")
    mem = {(r["T"], r["mode"], r["impl"]): r.get("peak_bytes") if r.get("peak_bytes") is not None
           else r.get("xla_bytes") for r in rows if r.get("launch") in ("torch", "jax")}
    cols = list(dict.fromkeys(k[2] for k, b in mem.items() if b is not None))
    if cols:
        out += ["Peak device memory of one call, MiB (torch: max_memory_allocated over the "
                "call less what was allocated before, outputs included; JAX: XLA's compiled "
                "plan, temporaries + outputs):", "",
                "| T | mode | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
        for T, mode in dict.fromkeys(k[:2] for k in mem):
            cell = lambda i: mem.get((T, mode, i))  # noqa: E731
            out.append(f"| {T} | {mode} | " + " | ".join(
                "-" if cell(i) is None else f"{cell(i) / 2 ** 20:.0f}" for i in cols) + " |")
        out.append("")
    pairs = [(r, next((s for s in rows if s.get("launch") == "torch-synced"
                       and s["family"] == r["family"] and s["T"] == r["T"]
                       and s["mode"] == r["mode"]), None))
             for r in rows if r.get("launch") == "jax"]
    if pairs:
        out += ["JAX launch against the torch launch, both synchronized before and after "
                "each call (JAX runs on its own stream), same process:", "",
                "| T | family | mode | JAX ms | torch ms | JAX / torch |",
                "|---|---|---|---|---|---|"]
        for j, t in pairs:
            out.append(f"| {j['T']} | {j['family']} | {j['mode']} | {_ms(j.get('ms'))} | "
                       f"{_ms((t or {}).get('ms'))} | {_ratio(j.get('ms'), (t or {}).get('ms'))} |")
        out.append("")
    agree = [r for r in rows if r.get("vs_ours_chunk") is not None and r.get("mode") == "fwd"]
    agree += [r for r in _rows(result, "speed", "agree") if r.get("jax_vs_torch") is not None]
    if agree:
        out += ["Agreement before timing (relative L2 difference of the forward output): "
                + "; ".join(f"{r['impl']} vs ours chunk, T={r['T']}: {r['vs_ours_chunk']:.1e}"
                            if "impl" in r else
                            f"{r['family']} JAX vs torch launch, T={r['T']}: "
                            f"{r['jax_vs_torch']:.1e}"
                            for r in agree) + ".", ""]
    launches = _rows(result, "speed", "launch")
    if launches:
        T = next((r.get("T") for r in launches if r.get("T")), "?")
        out += [f"Per launch at T={T} (`parity.bench.gpu.launch_times`; bound: max(dot FLOPs / "
                "measured matmul rate, HBM bytes / measured copy rate)):", "",
                "| family | stage | kernel | grid | ms | bound ms | ms / bound |",
                "|---|---|---|---|---|---|---|"]
        for r in launches:
            if r.get("status", "ok") != "ok":
                out.append(f"| {r['family']} | - | error: {r['error']} | - | - | - | - |")
                continue
            out.append(f"| {r['family']} | {r['stage']} | {r['kernel']} | {tuple(r['grid'])} | "
                       f"{_ms(r['ms'])} | {_ms(r['bound_ms'])} | "
                       f"{_ratio(r['ms'], r['bound_ms'])} |")
        out.append("")
    return out


def _varlen_table(result):
    st = _step(result, "varlen")
    rows, r = _rows(result, "varlen"), st["result"]
    if not rows:
        return ["not measured in this run."]
    lens = r.get("seqlens") or []
    out = [f"{len(lens)} packed sequences, {r.get('tokens')} tokens (lengths {min(lens or [0])} to "
           f"{max(lens or [0])}), (H,K,V) = {tuple(r.get('heads') or ())}; offsets on the device. "
           "Host sync: torch.cuda.set_sync_debug_mode('error') around a warmed call.", "",
           "| implementation | fwd ms | fwd+bwd ms | host sync fwd | host sync fwd+bwd | "
           "rel. diff vs ours |", "|---|---|---|---|---|---|"]
    for impl in dict.fromkeys(x["impl"] for x in rows):
        f = next((x for x in rows if x["impl"] == impl and x["mode"] == "fwd"), {})
        b = next((x for x in rows if x["impl"] == impl and x["mode"] == "fwdbwd"), {})
        sync = lambda x: (f"{x['status']}: {x['error']}" if x.get("error") else  # noqa: E731
                          "none" if x.get("host_sync") is None else x["host_sync"])
        diff = f.get("vs_ours")
        out.append(f"| {impl} | {_cell(f)} | {_cell(b)} | {sync(f)} | {sync(b)} | "
                   f"{'-' if diff is None else f'{diff:.1e}'} |")
    if "stand_in_host_sync" in r:
        out += ["", "Stand-in for the host-sync check (dry run): the contract's offsets check "
                "on offsets posing as CUDA: "
                + ("no host read." if r["stand_in_host_sync"] is None else r["stand_in_host_sync"])]
    return out + [""]


def _decode_table(result):
    st = _step(result, "decode")
    rows, r = _rows(result, "decode"), st["result"]
    if not rows:
        return ["not measured in this run."]
    impls = list(dict.fromkeys(x["impl"] for x in rows))
    out = [f"GLA layer, hidden {r.get('hidden')}, {r.get('heads')} heads, {r.get('dtype')}, one "
           f"token a step with its state, {r.get('steps')} steps a run, median of "
           f"{r.get('runs')} alternating runs after two warm-ups; fla: the same layer and "
           "weights with fla's fused_recurrent_gla as its recurrence"
           + (f" ({r['fla']})" if r.get("fla") else "") + ".", "",
           "| batch | " + " | ".join(f"{n} ms/token" for n in impls)
           + " | fla / ours | rel. diff to ours (one step) |",
           "|---|" + "---|" * (len(impls) + 2)]
    for B, by in _decode_by_batch(rows).items():
        ours, fla = by.get("ours", {}), next((x for n, x in by.items() if "fla" in n), {})
        ms = lambda x: x.get("ms") if x.get("status") == "ok" else None  # noqa: E731
        diff = fla.get("vs_ours")
        out.append(f"| {B} | " + " | ".join(_cell(by.get(n)) for n in impls)
                   + f" | {_ratio(ms(fla), ms(ours))} | "
                   + f"{'-' if diff is None else f'{diff:.1e}'} |")
    errors = [x for x in rows if x.get("status") != "ok"]
    if errors:
        out += ["", "Not timed (each on its own row; the others measured):", ""]
        out += [f"- {x['impl']}, batch {x['batch']}: {x['status']}: {x['error']}"
                for x in errors]
    return out + [""]


def _decode_by_batch(rows):
    by = {}
    for x in rows:
        by.setdefault(x["batch"], {})[x["impl"]] = x
    return by


TARGET_RATIO = 1.2  # issue 41: fla's time over ours, forward and forward+backward


def targets(result) -> list:
    """(target, 'met' | 'NOT met' | 'not measured', figure) per target (issues 30, 31, 41)."""
    out = []
    rows = [r for r in _rows(result, "speed") if r.get("status", "ok") == "ok"]
    for mode in ("fwd", "fwdbwd"):
        for T in sorted({r["T"] for r in _rows(result, "speed")}):
            get = lambda pred, key="ms": next(  # noqa: E731
                (r.get(key) for r in rows if r["T"] == T and r.get("mode") == mode
                 and pred(r["impl"])), None)
            ours = get(lambda i: i == "ours chunk (torch)")
            fla = get(lambda i: i.endswith("chunk_gla"))
            name = f"fla chunk_gla / ours chunk >= {TARGET_RATIO}, {mode}, T={T}"
            out.append((name, "not measured" if not ours or not fla else
                        "met" if fla >= TARGET_RATIO * ours else "NOT met",
                        f"{_ratio(fla, ours)} ({_ms(ours)} vs {_ms(fla)} ms)"))
            ours_b = get(lambda i: i == "ours chunk (torch)", "peak_bytes")
            fla_b = get(lambda i: i.endswith("chunk_gla"), "peak_bytes")
            if ours_b is not None and fla_b is not None:
                out.append((f"peak memory of ours chunk at most fla's, {mode}, T={T}",
                            "met" if ours_b <= fla_b else "NOT met",
                            f"{ours_b / 2 ** 20:.0f} vs {fla_b / 2 ** 20:.0f} MiB"))
    for r in rows:
        if r.get("launch") != "jax":
            continue
        t = next((s.get("ms") for s in rows if s.get("launch") == "torch-synced"
                  and s["family"] == r["family"] and s["T"] == r["T"] and s["mode"] == r["mode"]),
                 None)
        name = f"JAX launch within 5% of torch: {r['family']} {r['mode']} T={r['T']}"
        out.append((name, "not measured" if not r.get("ms") or not t else
                    "met" if r["ms"] <= 1.05 * t else "NOT met", f"{_ratio(r.get('ms'), t)}"))
    ours = [r for r in _rows(result, "varlen") if r["impl"].startswith("ours")]
    stand_in = _step(result, "varlen")["result"]
    if "stand_in_host_sync" in stand_in:
        read = stand_in["stand_in_host_sync"]
        out.append(("varlen: our call makes no host sync (stand-in: the contract's check on "
                    "offsets posing as CUDA)", "met" if read is None else "NOT met",
                    read or "no host read"))
    elif ours:
        syncs = [r.get("host_sync") for r in ours if r.get("status", "ok") == "ok"]
        ok = len(syncs) == len(ours) and all(s is None for s in syncs)
        out.append(("varlen: our call makes no host sync", "met" if ok else "NOT met",
                    "; ".join(f"{r['mode']}: {r.get('error') or r.get('host_sync') or 'none'}"
                              for r in ours)))
    for B, by in _decode_by_batch(_rows(result, "decode")).items():
        ours = (by.get("ours") or {}).get("ms")
        fla = next((x.get("ms") for n, x in by.items() if "fla" in n), None)
        if ours and fla:
            out.append((f"decode batch {B}: ours no slower than fla",
                        "met" if ours <= fla else "NOT met",
                        f"{_ms(ours)} vs {_ms(fla)} ms/token"))
    return out


def _machine_line(result):
    m = _step(result, "machine")["result"]
    v = m.get("versions", {})
    names = ("python", "torch", "triton", "jax", "jaxlib", "jax-triton", "fla-core")
    parts = [f"{m.get('device', 'device unknown (the machine step failed)')}"]
    if m.get("driver"):
        parts.append(f"driver {m['driver']}")
    if m.get("torch_cuda"):
        parts.append(f"CUDA {m['torch_cuda']}")
    if m.get("sm_count"):
        parts.append(f"{m['sm_count']} SMs, L2 {(m.get('l2_bytes') or 0) / 2 ** 20:.0f} MiB, "
                     f"{(m.get('memory_bytes') or 0) / 2 ** 30:.0f} GiB")
    line = (f"Measured by `{result['command']}` ({result['kit']}; {result['wall_s']:.0f} s of its "
            f"{result['budget_s']:.0f} s budget) on {', '.join(parts)}, {result['date']}, "
            f"commit {result['commit']}: "
            + ", ".join(f"{n} {v[n]}" for n in names if n in v) + ".")
    if m.get("matmul_tflops"):
        line += (f" Measured ceilings: {m['matmul_dtype']} matmul {m['matmul_tflops']:.3g} "
                 f"TFLOP/s ({m['matmul_n']}^3), copy {m['copy_gbps']:.3g} GB/s "
                 f"({m['copy_bytes'] / 2 ** 20:.0f} MiB, read + write).")
    return line


def steps_table(result) -> list:
    out = ["| step | status | seconds (cap, estimate) | found |", "|---|---|---|---|"]
    for s in result["steps"]:
        found = summary(s) or ""
        if s.get("error"):
            found = (found + "; " if found else "") + s["error"].replace("|", "/")[:200]
        out.append(f"| {s['name']} | {s['status']} | {s['wall_s']:.0f} ({s['cap_s']:.0f}, "
                   f"{s['estimate_s']:.0f}) | {found} |")
    return out


def _ranking_lines(result) -> list:
    """mode="auto"'s ranking the kit wrote into tuning.json (parity/gpu/ranking.py)."""
    if "ranking" not in result:  # a JSON from before the ranking
        return []
    r = result["ranking"]
    head = "mode=\"auto\"'s ranking (forward+backward, parity/gpu/ranking.py)"
    if r.get("error"):
        return [f"{head}: not written ({r['error']}).", ""]
    if not r.get("entries"):
        return [f"{head}: none (no length timed the cost rule's family and another).", ""]
    ms = r.get("ms") or {}

    def times(T):
        return "; ".join(f"{f} {x:.3f}" for f, x in sorted(ms.get(str(T), {}).items()))
    return [f"{head}, `{key}` in tuning.json: "
            + ", ".join(f"T={t} {f} ({times(t)} ms)" for t, f in zip(e["T"], e["fastest"]))
            + "." for key, e in r["entries"].items()] + [""]


def markdown(result) -> str:
    """BENCHMARKS.md's GPU section (without its heading)."""
    out = []
    if result["kit"] == "dry-run":
        out += ["**Dry run on the CPU: stand-ins, not measurements.** It proves the kit's "
                "orchestration; every figure below comes from these stand-ins:", ""]
        out += [f"- {s}" for s in result["stand_ins"]] + [""]
    out += [_machine_line(result), "", "Steps, in order, each under its own time cap:", ""]
    out += steps_table(result) + [""]
    corr = _step(result, "correctness")
    failed = [r for r in corr["rows"] if r.get("kind") == "test" and r["outcome"] == "failed"]
    out += ["### Correctness on the device", "",
            f"`{corr['result'].get('command', 'pytest tests/test_cuda.py')}`: "
            f"{summary(corr) or 'not run'}."]
    out += [f"- FAILED {r['name']}: {r['message']}" for r in failed] + [""]
    s = _step(result, "speed")
    B, H, K, V = (s["result"].get(k) for k in ("B", "H", "K", "V"))
    out += [f"### Speed, (B,H,K,V) = ({B},{H},{K},{V}), GLA key gate", ""]
    tune = _step(result, "tune")
    out += [f"fla's autotuning (tune step, parity/gpu/ahead.py): "
            f"{render_kernels.tune_line(tune['result']) or tune.get('error') or 'not run'}.", ""]
    out += _speed_tables(result) + _ranking_lines(result)
    out += ["### Packed variable-length sequences", ""] + _varlen_table(result)
    out += ["### Decoding", ""] + _decode_table(result)
    out += render_kernels.markdown(result, _step)
    out += ["### Targets", ""]
    if result["kit"] == "dry-run":
        out += ["(Stand-ins: these statuses say nothing about a GPU.)", ""]
    out += ["| target | status | figure |", "|---|---|---|"]
    out += [f"| {n} | {'**NOT met**' if st == 'NOT met' else st} | {fig} |"
            for n, st, fig in targets(result)]
    return "\n".join(out).rstrip() + "\n"


def table(result) -> str:
    """The short table printed last: each step, then the chunked kernels against fla."""
    lines = [f"gpu kit ({result['kit']}): {result['wall_s']:.0f} s of {result['budget_s']:.0f} s"]
    lines += steps_table(result)
    marks = [t for t in targets(result) if t[1] != "not measured"]
    if marks:
        lines += ["", "Targets" + (" (stand-ins: they say nothing about a GPU)"
                                   if result["kit"] == "dry-run" else "") + ":", "",
                  "| target | status | figure |", "|---|---|---|"]
        lines += [f"| {n} | {st} | {fig} |" for n, st, fig in marks]
    return "\n".join(lines)


def replace_section(md_text, body, heading="## GPU") -> str:
    """md_text with its GPU section's body replaced by `body` (parity.sections)."""
    return sections.replace_section(md_text, body, heading)


def update_files(result, md_path=None, results_json=None, json_copy=None) -> list:
    """Write the section into BENCHMARKS.md (`md_path`) and results.json["gpu"] (which
    `python -m parity.bench` keeps on a machine without a GPU), and the kit's JSON beside
    it (`json_copy`); the paths written."""
    body = markdown(result)
    written = []
    if md_path:
        with open(md_path) as f:
            text = f.read()
        with open(md_path, "w") as f:
            f.write(replace_section(text, body))
        written.append(md_path)
    if results_json:
        with open(results_json) as f:
            data = json.load(f)
        data["gpu"] = body.rstrip("\n")
        with open(results_json, "w") as f:
            json.dump(data, f, indent=1)
        written.append(results_json)
    if json_copy:
        with open(json_copy, "w") as f:
            json.dump(result, f, indent=1, default=str)
        written.append(json_copy)
    return written
