"""flash-linear-attention (fla), the anchor: its ops (or their CPU stand-ins) and control
of its autotuner. The kit tunes fla once, alone on the GPU (parity/gpu/ahead.py), writes
the winners (`winners`, OUT/fla-configs.json), and every timed process loads them and
refuses to tune (`prepare`): a timing never includes autotuning, and a later run given
`--fla-configs FILE` tunes nothing."""

import json
import sys

from .standins import FLA_STANDINS, STANDIN_MODULE

FLA_MODULES = ("fla.",)


class NotWarmed(RuntimeError):
    """fla would autotune in a timed process (its warm-up did not reach this kernel)."""


def ops(plan):
    """({"chunk_gla": fn, "fused_recurrent_gla": fn}, None) or (None, why absent); the
    CPU stand-ins in the dry run; absent when the plan says so (`--inject fla=absent`)."""
    if plan.fla == "absent":
        return None, "fla absent (--inject fla=absent)"
    if plan.dry:
        return dict(FLA_STANDINS), None
    try:
        from fla.ops.gla import chunk_gla, fused_recurrent_gla
    except Exception as e:  # not installed, or broken against this torch/triton
        return None, f"fla-core unavailable ({type(e).__name__}: {str(e)[:200]})"
    return {"chunk_gla": chunk_gla, "fused_recurrent_gla": fused_recurrent_gla}, None


def modules(plan) -> tuple:
    """Module name prefixes whose Triton autotuners are fla's (the stand-in's in a dry run)."""
    return (STANDIN_MODULE,) if plan.dry else FLA_MODULES


def no_autotune():
    """From now on in this process, any Triton autotuning raises NotWarmed."""
    from triton.runtime import autotuner

    def refuse(self, *args, **kwargs):
        raise NotWarmed(f"fla's autotuner for {self.base_fn.__name__} was not warmed "
                        "within the warm-up's cap")
    autotuner.Autotuner._bench = refuse


def subset(i, n):
    """Make every Triton autotuner in this process benchmark only configs i, i+n, ..."""
    from triton.runtime import autotuner

    prune = autotuner.Autotuner.prune_configs

    def pruned(self, *args, **kwargs):
        configs = prune(self, *args, **kwargs)
        return configs[i % len(configs)::n] or configs[:1]
    autotuner.Autotuner.prune_configs = pruned


def autotuners(prefixes) -> dict:
    """{(module, kernel name): Triton Autotuner} of the loaded modules named by `prefixes`
    (an autotuner under other decorators found through their .fn)."""
    from triton.runtime.autotuner import Autotuner

    found = {}
    for name, mod in list(sys.modules.items()):
        if mod is None or not name.startswith(tuple(prefixes)):
            continue
        for obj in list(vars(mod).values()):
            for _ in range(4):
                if isinstance(obj, Autotuner):
                    found[(obj.base_fn.__module__, obj.base_fn.__name__)] = obj
                    break
                obj = getattr(obj, "fn", None)
                if obj is None:
                    break
    return found


def _config_dict(c) -> dict:
    return {"kwargs": dict(c.kwargs), "num_warps": c.num_warps, "num_stages": c.num_stages,
            "num_ctas": getattr(c, "num_ctas", 1), "maxnreg": getattr(c, "maxnreg", None)}


def _plain(x):
    """A key element as JSON keeps it (str of anything else: such a key then never
    matches when loaded, and that kernel shows as not warmed)."""
    return x if x is None or isinstance(x, (bool, int, float, str)) else str(x)


def winners(prefixes) -> list:
    """Every tuned choice of the autotuners of `prefixes` in this process:
    [{module, kernel, key, config}] (JSON)."""
    out = []
    for (module, kernel), at in sorted(autotuners(prefixes).items()):
        for key, config in at.cache.items():
            out.append({"module": module, "kernel": kernel, "key": [_plain(x) for x in key],
                        "config": _config_dict(config)})
    return out


def load_winners(records, prefixes) -> int:
    """Put `winners`' records into this process's autotuners (imported first: call the
    ops once, or import their modules); how many found their autotuner."""
    import triton

    found, n = autotuners(prefixes), 0
    for r in records:
        at = found.get((r["module"], r["kernel"]))
        if at is None:
            continue
        c = r["config"]
        extra = {"maxnreg": c["maxnreg"]} if c.get("maxnreg") is not None else {}
        at.cache[tuple(r["key"])] = triton.Config(c["kwargs"], num_warps=c["num_warps"],
                                                  num_stages=c["num_stages"],
                                                  num_ctas=c.get("num_ctas", 1), **extra)
        n += 1
    return n


def write_records(path, records, source):
    with open(path, "w") as f:
        json.dump({"source": source, "winners": records}, f, indent=1)


def write_winners(path, plan, source) -> int:
    """Write this process's fla winners to `path` (JSON); how many."""
    records = winners(modules(plan))
    write_records(path, records, source)
    return len(records)


def read_winners(path) -> list:
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data.get("winners"), list):
        raise ValueError(f"{path}: not a file of fla's autotuner winners (no 'winners' list)")
    return data["winners"]


def prepare(plan, configs=None):
    """A timed process's fla: its ops imported, the winners in `configs` (a path, when
    the file exists) loaded, autotuning refused. (ops, why absent, winners loaded)."""
    import os

    fns, why = ops(plan)
    loaded = 0
    if fns is not None:
        if configs and os.path.exists(configs):
            loaded = load_winners(read_winners(configs), modules(plan))
        no_autotune()
    return fns, why, loaded
