"""flash-linear-attention (fla), the anchor: its ops (or their CPU stand-ins) and control
of its autotuner (parity/gpu/ahead.py says how the kit warms it, with the calls the timed
steps make of it: compiled in parallel, tuned alone, never tuned inside a timing)."""

from .standins import FLA_STANDINS


class NotWarmed(RuntimeError):
    """fla would autotune in a timed process (its warm-up did not reach this kernel)."""


def ops(plan):
    """({"chunk_gla": fn, "fused_recurrent_gla": fn}, None) or (None, why absent); the
    CPU stand-ins in the dry run."""
    if plan.dry:
        return dict(FLA_STANDINS), None
    try:
        from fla.ops.gla import chunk_gla, fused_recurrent_gla
    except Exception as e:  # not installed, or broken against this torch/triton
        return None, f"fla-core unavailable ({type(e).__name__}: {str(e)[:200]})"
    return {"chunk_gla": chunk_gla, "fused_recurrent_gla": fused_recurrent_gla}, None


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

