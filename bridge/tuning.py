"""Launch configs by device: the table the launch lists read their defaults from.

Each kernel family names its tunable launch sites and the knobs of each (num_warps,
num_stages, tile sizes; `SITES` in bridge/kernels/chunk.py and fused_recurrent.py) and
asks `pick(plan, family, site, defaults)` while it builds a launch list. `pick` returns
`defaults` (the family's own choices) updated with the entry of the table for the
current device, if there is one for this call's kind:

    tuning.json: {"schema": SCHEMA, "devices": {DEVICE: {"source": str,
                  "entries": {ENTRY: {knob: value}}}}}
    DEVICE  "<capability> <name>", e.g. "9.0 NVIDIA H100 80GB HBM3" (`device_key`)
    ENTRY   "<family>/<site>/<dtype>/K<K>/V<V>/<gates>" (`entry_key`: K and V as
            powers of two, the gates as `gate_signature`)

The table ships with the package; the GPU kit's config sweep (`python -m parity.gpu`,
JSON key "sweep") measures the entries on one device and writes them as a table file,
which `python -m bridge.tuning --merge FILE` adds to this one. On the CPU, under Triton's
interpreter, and on a device the table does not name, every launch keeps its family's
defaults. Nothing is tuned at a call: a launch list is a pure function of the plan and
this table. `overriding` replaces entries within a block (the sweep's candidates, tests).

A few defaults are rules on the device rather than constants: on its size (fused_chunk's
split of each sequence across programs: `multiprocessors()`, its SM count) and on its
instruction set (fused_chunk's tiles where the products are wgmma: `capability()`), both
known only where a GPU is (None on the CPU and under the interpreter, where such a rule
keeps the plain launch and the sm_80 tiles; `on_device` names a device, as the
ahead-of-time builds do for each arch).
"""

import argparse
import contextlib
import functools
import itertools
import json
import os
import sys

SCHEMA = "gla-bridge/tuning/1"
TABLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tuning.json")
_OVERRIDES = []   # a stack of {(family, site): knobs}
_DEVICE = []      # a stack of (device key, SM count) that replace detection (tests)
_RECORD = []      # dicts that `recording` blocks fill with {(family, site): defaults}


def gate_signature(plan) -> str:
    """The gates of a call as one token, e.g. "g=key" or "g=key+gk+gv+gamma=head"."""
    parts = [f"g={plan.g}"] + (["gk"] if plan.gk else []) + (["gv"] if plan.gv else [])
    if plan.g_gamma != "none":
        parts.append(f"gamma={plan.g_gamma}")
    return "+".join(parts)


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def entry_key(plan, family: str, site: str) -> str:
    """The table's key of one launch site for one kind of call (module doc)."""
    return (f"{family}/{site}/{plan.dtype}/K{_pow2(plan.K)}/V{_pow2(plan.V)}/"
            f"{gate_signature(plan)}")


def _torch_device(torch):
    i = torch.cuda.current_device()
    cap = torch.cuda.get_device_capability(i)
    return (f"{cap[0]}.{cap[1]} {torch.cuda.get_device_name(i)}",
            torch.cuda.get_device_properties(i).multi_processor_count)


@functools.lru_cache(maxsize=None)
def _detected():
    """(key, SM count) of the current CUDA device, or (None, None) (CPU, interpreter, no
    GPU framework): from torch where it has started CUDA, else from JAX's first GPU (its
    `core_count`, the SM count, where the device has one), else from torch (a JAX
    process does not start torch's CUDA for this)."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return None, None
    torch, jax = sys.modules.get("torch"), sys.modules.get("jax")
    try:
        if torch is not None and torch.cuda.is_initialized():
            return _torch_device(torch)
    except Exception:  # a broken driver: the defaults
        pass
    try:
        if jax is not None:
            d = jax.devices("gpu")[0]
            return f"{d.compute_capability} {d.device_kind}", getattr(d, "core_count", None)
    except Exception:  # no GPU backend
        pass
    try:
        if torch is not None and torch.cuda.is_available():
            return _torch_device(torch)
    except Exception:
        pass
    return None, None


def device_key():
    """"<capability> <name>" of the device launches go to, or None (module doc)."""
    return _DEVICE[-1][0] if _DEVICE else _detected()[0]


def multiprocessors():
    """The SM count of the device launches go to, or None where unknown (module doc)."""
    return _DEVICE[-1][1] if _DEVICE else _detected()[1]


def capability():
    """(major, minor) of the device launches go to, read from `device_key()`, or None
    where unknown (a rule on the device's instruction set: fused_chunk's wgmma tiles)."""
    key = device_key()
    try:
        major, minor = key.split(None, 1)[0].split(".")
        return int(major), int(minor)
    except (AttributeError, ValueError):
        return None


def wgmma() -> bool:
    """Whether the device's tensor-core products are wgmma (capability 9.x, whose operands
    come from shared memory); False where the device is unknown, whose tiles are sm_80's."""
    return (capability() or (0, 0))[0] == 9


@contextlib.contextmanager
def on_device(key, sms=None):
    """Within the block, `device_key()` is `key` and `multiprocessors()` is `sms` (a
    device named without detecting it)."""
    _DEVICE.append((key, sms))
    try:
        yield
    finally:
        _DEVICE.pop()


@contextlib.contextmanager
def overriding(knobs: dict):
    """Within the block, pick(plan, family, site, ...) takes knobs[(family, site)] last."""
    _OVERRIDES.append(dict(knobs))
    try:
        yield
    finally:
        _OVERRIDES.pop()


def load(path=TABLE) -> dict:
    """A table file, checked: {"schema", "devices": {DEVICE: {"source", "entries"}}}."""
    with open(path) as f:
        table = json.load(f)
    if table.get("schema") != SCHEMA or not isinstance(table.get("devices"), dict):
        raise ValueError(f"{path}: not a tuning table (schema {SCHEMA!r} with 'devices')")
    for dev, rec in table["devices"].items():
        if not isinstance(rec, dict) or not isinstance(rec.get("entries"), dict):
            raise ValueError(f"{path}: device {dev!r} has no 'entries'")
    return table


@functools.lru_cache(maxsize=None)
def _shipped() -> dict:
    return load(TABLE)["devices"]


def entries(device=None) -> dict:
    """{ENTRY: knobs} of the shipped table for `device` (default: the current one)."""
    device = device_key() if device is None else device
    return (_shipped().get(device) or {}).get("entries", {}) if device else {}


def pick(plan, family: str, site: str, defaults: dict) -> dict:
    """`defaults` updated with the table's entry for this device and call, then with any
    `overriding` block's knobs; a knob `defaults` does not name is a ValueError."""
    for seen in _RECORD:
        seen.setdefault((family, site), dict(defaults))
    out = dict(defaults)
    found = [entries().get(entry_key(plan, family, site), {})]
    found += [o[(family, site)] for o in _OVERRIDES if (family, site) in o]
    for knobs in found:
        unknown = set(knobs) - set(defaults)
        if unknown:
            raise ValueError(f"tuning: {family}/{site} has no knob {sorted(unknown)} "
                             f"(its knobs: {sorted(defaults)})")
        out.update(knobs)
    return out


@contextlib.contextmanager
def recording():
    """A dict that fills, within the block, with {(family, site): defaults} of each
    site `pick` is asked for (without the table or overrides)."""
    seen = {}
    _RECORD.append(seen)
    try:
        yield seen
    finally:
        _RECORD.remove(seen)


def sites(plan, mode) -> dict:
    """{(family, site): defaults} of every launch site of one call's forward and backward
    (with the final state's gradient) in the kernel family `mode`."""
    from .kernels import family

    fam = family(mode)
    with recording() as seen, on_device(None):
        fam.forward_launches(plan)
        fam.backward_launches(plan, True, fam.kept(plan))
    return seen


def _fits(plan, knob, value) -> bool:
    """Tiles from 16 to the (power-of-two) dimension they block (K: BK, BKI; V: BV, SV);
    other knobs as listed."""
    if knob in ("BK", "BKI", "BV", "SV"):
        return 16 <= value <= _pow2(plan.K if knob in ("BK", "BKI") else plan.V)
    return True


def candidates(plan, mode, quick=False) -> list:
    """[(family, site, knobs)] the config sweep tries for one call in the family `mode`:
    each site's defaults first, then every combination of its family's `SITES` values
    for the knobs the site has (`quick`: one knob changed at a time), tiles that fit."""
    from .kernels import family

    table = getattr(family(mode), "SITES", {})  # a family without sites: its defaults
    out = []
    for (fam, site), defaults in sites(plan, mode).items():
        grid = {k: [x for x in table.get(site, {}).get(k, ()) if _fits(plan, k, x)]
                for k in defaults}
        grid = {k: v for k, v in grid.items() if v}
        seen = [defaults]
        if quick:
            combos = [dict(defaults, **{k: x}) for k, xs in grid.items() for x in xs]
        else:
            combos = [dict(defaults, **dict(zip(grid, xs)))
                      for xs in itertools.product(*grid.values())]
        seen += [c for c in combos if c != defaults]
        unique = [c for i, c in enumerate(seen) if c not in seen[:i]]
        out += [(fam, site, c) for c in unique]
    return out


def table_of(device: str, source: str, winners: dict) -> dict:
    """A table file's contents for one device: winners {ENTRY: knobs}."""
    return {"schema": SCHEMA, "devices": {device: {"source": source, "entries": winners}}}


def merge(table: dict, new: dict) -> dict:
    """`table` with every device of `new` (a table) added, or replacing its entries."""
    out = {"schema": SCHEMA, "devices": dict(table["devices"])}
    for dev, rec in new["devices"].items():
        old = out["devices"].get(dev, {"source": "", "entries": {}})
        out["devices"][dev] = {"source": rec.get("source", ""),
                               "entries": dict(old["entries"], **rec["entries"])}
    return out


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bridge.tuning", description=__doc__.split("\n")[0])
    p.add_argument("--merge", metavar="FILE", help="add a table file (the GPU kit's sweep "
                                                   "writes tuning.json) to the shipped table")
    p.add_argument("--table", default=TABLE, help="the table to show or merge into")
    a = p.parse_args(argv)
    table = load(a.table)
    if a.merge:
        table = merge(table, load(a.merge))
        with open(a.table, "w") as f:
            json.dump(table, f, indent=1, sort_keys=True)
            f.write("\n")
    for dev, rec in sorted(table["devices"].items()):
        print(f"{dev}: {len(rec['entries'])} entries ({rec.get('source', '')})")
    if not table["devices"]:
        print("no device entries: every launch uses its family's defaults")


if __name__ == "__main__":
    main()
