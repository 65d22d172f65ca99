"""mode="auto"'s ranking, from the speed step's rows: the Triton family timed fastest at
each length, added to the kit's device table (OUT/tuning.json) as the dispatcher's entry
(`bridge.dispatch.RANKING`), so that `python -m bridge.tuning --merge` ships it with the
sweep's configs.

The rows read are ours from torch, forward+backward (the training call; one ranking, so
that a call runs the same kernels with and without gradients), at the speed step's
(B, T, H, K, V), dtype and gate (GLA's key gate): one entry, for that kind of call
(`bridge.tuning.entry_key`), listing each length with its fastest family. A family
displaces the cost rule's choice (`bridge.dispatch.cost_choice`) only when faster by more
than the sweep's MARGIN; a length where that choice has no time ranks nothing. Runs in
the kit's own process after every step (it starts no GPU work).
"""

import json
import os

from bridge import dispatch, tuning

from .plan import FAMILIES
from .sweep import DRY_DEVICE, MARGIN


def call_plan(plan, T):
    """The speed step's call at length T as a bridge Plan (fp32 in the dry run)."""
    from parity.compiled import report

    return report.report_plan((plan.B, T, plan.H, plan.K, plan.V),
                              "fp32" if plan.dry else "bf16", "key")


def times(result) -> dict:
    """{T: {family: ms}} of ours from torch, forward+backward, timed ok."""
    speed = next((s for s in result["steps"] if s["name"] == "speed"), {"rows": []})
    out = {}
    for r in speed["rows"]:
        if (r.get("kind") == "row" and r.get("mode") == "fwdbwd" and r.get("status") == "ok"
                and r.get("family") in FAMILIES and r.get("impl") == f"ours {r['family']} (torch)"
                and r.get("ms")):
            out.setdefault(r["T"], {})[r["family"]] = r["ms"]
    return out


def ranking(plan, measured: dict) -> dict:
    """{ENTRY: {"T": [...], "fastest": [...]}} from `times`' figures ({} if none ranks)."""
    ranked = []
    for T in sorted(measured):
        ms = measured[T]
        incumbent = dispatch.cost_choice(call_plan(plan, T))
        if incumbent not in ms:
            continue
        best = min(ms, key=ms.get)
        ranked.append((T, best if ms[best] < (1 - MARGIN) * ms[incumbent] else incumbent))
    if not ranked:
        return {}
    key = tuning.entry_key(call_plan(plan, ranked[0][0]), *dispatch.RANKING)
    return {key: {"T": [t for t, _ in ranked], "fastest": [f for _, f in ranked]}}


def device_of(plan, machine: dict) -> str:
    """The table's key of the machine step's device (`bridge.tuning.device_key`'s form)."""
    if plan.dry:
        return DRY_DEVICE
    if machine.get("capability") and machine.get("device"):
        return f"{machine['capability']} {machine['device']}"
    return "unknown device"


def write(out_path, result, plan, machine) -> dict:
    """Add the ranking to the table file at `out_path` (made if the sweep wrote none);
    what was added, with the figures it came from."""
    measured = times(result)
    entry = ranking(plan, measured)
    device = device_of(plan, machine)
    table = (tuning.load(out_path) if os.path.exists(out_path)
             else {"schema": tuning.SCHEMA, "devices": {}})
    rec = table["devices"].setdefault(device, {"source": "python -m parity.gpu speed",
                                               "entries": {}})
    rec["entries"].update(entry)
    with open(out_path, "w") as f:
        json.dump(table, f, indent=1, sort_keys=True)
    return {"device": device, "entries": entry,
            "ms": {str(T): fams for T, fams in sorted(measured.items())}}
