"""The kit's JSON (`gpu.json`) read back: its schema, BENCHMARKS.md's GPU section, the
short table printed last, and the section's place in BENCHMARKS.md and results.json.

Schema "gla-bridge/gpu-kit/1": {schema, kit (full | quick | dry-run), command, date,
commit, budget_s, wall_s, stand_ins [str], steps [{name, status (ok | error | timed_out
| skipped), cap_s, estimate_s, wall_s, error, result {}, rows []}]}, the steps in
plan.STEPS order. Rows carry a "kind" ("test", "row", "launch", "agree", "call")."""

import json

from .. import sections
from .plan import STEPS

SCHEMA = "gla-bridge/gpu-kit/1"
STATUSES = ("ok", "error", "timed_out", "skipped")
TOP = {"schema": str, "kit": str, "command": str, "date": str, "commit": str,
       "budget_s": (int, float), "wall_s": (int, float), "stand_ins": list, "steps": list}
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
    if name in ("speed", "varlen", "decode"):
        got = [x for x in rows if x.get("kind") in ("row", "launch")]
        timed = sum(1 for x in got if x.get("ms") is not None or x.get("ours_ms") is not None)
        return f"{timed} of {len(got)} timings"
    return ""


def _speed_tables(result):
    rows = _rows(result, "speed")
    if not rows:
        return ["not measured in this run."]
    out = []
    Ts = sorted({r["T"] for r in rows})
    for mode, title in (("fwd", "Forward"), ("fwdbwd", "Forward + backward")):
        by = {(r["impl"], r["T"]): r for r in rows if r.get("mode") == mode}
        impls = list(dict.fromkeys(r["impl"] for r in rows if r.get("launch") in ("torch", "jax")))
        chunk = [i for i in impls if "chunk" in i]
        fused = [i for i in impls if "fused" in i]
        cols = chunk + fused
        out += [f"{title}, ms (median; fla / ours: fla's time over ours, above 1 where ours "
                "is faster):", "",
                "| T | " + " | ".join(cols) + " | chunk: fla / ours | fused: fla / ours |",
                "|---|" + "---|" * (len(cols) + 2)]
        for T in Ts:
            cell = lambda i: by.get((i, T), {}).get("ms")  # noqa: E731
            ours_c = cell(next((i for i in chunk if i.startswith("ours") and "torch" in i), ""))
            fla_c = cell(next((i for i in chunk if "fla" in i), ""))
            ours_f = cell(next((i for i in fused if i.startswith("ours") and "torch" in i), ""))
            fla_f = cell(next((i for i in fused if "fla" in i), ""))
            out.append(f"| {T} | " + " | ".join(_ms(cell(i)) for i in cols)
                       + f" | {_ratio(fla_c, ours_c)} | {_ratio(fla_f, ours_f)} |")
        out.append("")
    errors = [r for r in rows if r.get("error")]
    if errors:
        out += ["Not timed:", ""]
        out += [f"- {r['impl']}, T={r['T']}, {r.get('mode')}: {r['error']}" for r in errors]
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
            if r.get("error"):
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
        sync = lambda x: ("error: " + x["error"] if x.get("error") else  # noqa: E731
                          "none" if x.get("host_sync") is None else x["host_sync"])
        diff = f.get("vs_ours")
        out.append(f"| {impl} | {_ms(f.get('ms'))} | {_ms(b.get('ms'))} | {sync(f)} | {sync(b)} | "
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
    out = [f"GLA layer, hidden {r.get('hidden')}, {r.get('heads')} heads, {r.get('dtype')}, one "
           f"token a step with its state, {r.get('steps')} steps a run, median of "
           f"{r.get('runs')} alternating runs after two warm-ups; fla: the same layer and "
           "weights with fla's fused_recurrent_gla as its recurrence"
           + (f" ({r['fla']})" if r.get("fla") else "") + ".", "",
           "| batch | ours ms/token | fla ms/token | fla / ours | rel. diff (one step) |",
           "|---|---|---|---|---|"]
    for x in rows:
        if x.get("error"):
            out.append(f"| {x['batch']} | error: {x['error']} | - | - | - |")
            continue
        out.append(f"| {x['batch']} | {_ms(x['ours_ms'])} | {_ms(x['fla_ms'])} | "
                   f"{_ratio(x['fla_ms'], x['ours_ms'])} | {x['vs_fla']:.1e} |")
    return out + [""]


def targets(result) -> list:
    """(target, 'met' | 'NOT met' | 'not measured', figure) per issue-30/31 target."""
    out = []
    rows = _rows(result, "speed")
    for mode in ("fwd", "fwdbwd"):
        for T in sorted({r["T"] for r in rows}):
            get = lambda pred: next((r.get("ms") for r in rows if r["T"] == T  # noqa: E731
                                     and r.get("mode") == mode and pred(r["impl"])), None)
            ours = get(lambda i: i == "ours chunk (torch)")
            fla = get(lambda i: i.endswith("chunk_gla"))
            name = f"ours chunk {mode} at least as fast as fla chunk_gla, T={T}"
            out.append((name, "not measured" if not ours or not fla else
                        "met" if ours <= fla else "NOT met",
                        f"{_ms(ours)} vs {_ms(fla)} ms"))
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
        syncs = [r.get("host_sync") for r in ours if not r.get("error")]
        ok = len(syncs) == len(ours) and all(s is None for s in syncs)
        out.append(("varlen: our call makes no host sync", "met" if ok else "NOT met",
                    "; ".join(f"{r['mode']}: {r.get('error') or r.get('host_sync') or 'none'}"
                              for r in ours)))
    for r in _rows(result, "decode"):
        if not r.get("error"):
            out.append((f"decode batch {r['batch']}: ours no slower than fla",
                        "met" if r["ours_ms"] <= r["fla_ms"] else "NOT met",
                        f"{_ms(r['ours_ms'])} vs {_ms(r['fla_ms'])} ms/token"))
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
    if s["result"].get("ahead"):
        out += [f"Compiled and tuned ahead (parity/gpu/ahead.py): {s['result']['ahead']}.", ""]
    out += _speed_tables(result)
    out += ["### Packed variable-length sequences", ""] + _varlen_table(result)
    out += ["### Decoding", ""] + _decode_table(result)
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
