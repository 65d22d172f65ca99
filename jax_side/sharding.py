"""Many devices: the manual-axis types ("vma") that `jax.shard_map(check_vma=True)`
checks, and the partitioning rules that keep batch/head-sharded calls local.

Inside `shard_map` every value carries the set of mesh axes it varies over.
Our kernels mix all their inputs, so each call first lifts every input to the
union of those sets (`vary_all`: a type change, no data moves); kernel outputs,
callback results and custom_vjp cotangents are then declared with that set
(`struct`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import ManualAxisType, NamedSharding, PartitionSpec as P

from bridge.contract import ARGS, INPUTS, Plan


def varying(*xs) -> frozenset:
    """The mesh axes any of the arrays varies over (empty outside shard_map)."""
    axes = frozenset()
    for x in xs:
        if x is not None:
            axes |= jax.typeof(x).mat.varying
    return axes


def vary(x, axes):
    """x, typed as varying over `axes` too (a no-op where it already does)."""
    if x is None:
        return None
    missing = tuple(sorted(frozenset(axes) - jax.typeof(x).mat.varying))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def vary_all(*xs):
    """Every array of xs typed with the union of their varying axes."""
    axes = varying(*xs)
    return tuple(vary(x, axes) for x in xs)


def struct(shape, dtype, like=()):
    """A ShapeDtypeStruct varying over the axes of the arrays `like` (what Pallas
    outputs and host callback results need under shard_map's check_vma)."""
    axes = varying(*like)
    if not axes:
        return jax.ShapeDtypeStruct(shape, dtype)
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=ManualAxisType(varying=axes))


def lower_without_vma_check(fn, axes):
    """fn (arrays -> tuple of arrays), lowered with shard_map's vma check off when
    `axes` (the inputs' varying mesh axes) is not empty; fn itself unchanged otherwise.

    Why: Pallas' interpreter (jax 0.10.2) evaluates the kernel at lowering time
    mixing its unvaried scratch buffers and constants with the varying blocks, and
    fails the check ("Primitive add requires varying manual axes to match") although
    the kernel was traced, and its outputs typed, correctly. The check stays on for
    everything else; Mosaic (TPU) lowering is not affected and not wrapped.
    """
    if not axes:
        return fn
    return lambda *args: tuple(_NO_CHECK.bind(*args, fn=_Hashable(fn)))


class _Hashable:
    """A function as a primitive parameter (compared by identity)."""

    def __init__(self, fn):
        self.fn = fn


def _no_check_primitive():
    from jax._src import config  # the check's switch has no public context manager
    from jax.extend.core import Primitive
    from jax.interpreters import mlir

    p = Primitive("gla_lower_without_vma_check")
    p.multiple_results = True
    p.def_impl(lambda *args, fn: fn.fn(*args))
    p.def_abstract_eval(
        lambda *avals, fn: [o.aval for o in jax.make_jaxpr(fn.fn)(*avals).jaxpr.outvars])

    def lowering(ctx, *args, fn):
        # per device, the values are plain arrays: lower fn on unvaried types
        plain = lambda avals: [a.update(manual_axis_type=ManualAxisType()) for a in avals]
        ctx = ctx.replace(avals_in=plain(ctx.avals_in), avals_out=plain(ctx.avals_out))
        with config._check_vma(False):
            return mlir.lower_fun(fn.fn, multiple_results=True)(ctx, *args)

    mlir.register_lowering(p, lowering)
    return p


_NO_CHECK = _no_check_primitive()


# ---------------------------------------------------------------------------
# Batch / head sharding under plain jax.jit: a custom_partitioning rule.

def _dims(plan, name):
    """The sharding-rule factors of one argument (batched layout). Query heads are
    the compound (j g): j the kv head, g its group, so a head split keeps each kv
    group on one device; n, the sequence, is the batch b unless varlen."""
    hq = "(j g)" if plan.group > 1 else "j"
    n = "n" if plan.varlen else "b"
    if name == "g" and plan.g == "head":
        return f"b t {hq}"
    return {"q": f"b t {hq} k", "k": "b t j k", "v": "b t j v", "g": f"b t {hq} k",
            "gk": f"b t {hq} k", "gv": f"b t {hq} v", "g_gamma": f"{n} {hq}",
            "initial_state": f"{n} {hq} k v", "cu_seqlens": "c", "o": f"b t {hq} v",
            "final_state": f"{n} {hq} k v"}[name]


def _rule(plan, ins, outs):
    rule = ", ".join(_dims(plan, n) for n in ins) + " -> " + ", ".join(
        _dims(plan, n) for n in outs)
    sizes = {"g": plan.group} if plan.group > 1 else {}
    # time, key/value dims and packed sequences stay whole on a device
    keep = ("t", "k", "v") + (("n", "c") if plan.varlen else ())
    if "cu_seqlens" not in ins:
        keep = tuple(f for f in keep if f != "c")
    return rule, keep, sizes


def _local_plan(plan, ins, arrays):
    """The plan of one device's shard (batch and head counts shrink): `arrays` those
    named `ins` (then anything else, ignored)."""
    named = dict(zip(ins, arrays))
    return Plan.of_batched(named, named.get("cu_seqlens"), scale=plan.scale,
                           reverse=plan.reverse)


def _split(plan, mesh, spec_q):
    """(batch mesh axes, head mesh axes) to keep from q's sharding: the batch axis
    unless varlen, the head axis when it divides H and Hk alike."""
    def size(axes):
        axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        n = 1
        for a in axes:
            n *= mesh.shape[a]
        return axes, n

    spec = tuple(spec_q) + (None,) * (4 - len(tuple(spec_q)))
    b_axes, nb = size(spec[0])
    h_axes, nh = size(spec[2])
    if plan.varlen or plan.B % nb:
        b_axes = ()
    if plan.H % nh or plan.Hk % nh:
        h_axes = ()
    return b_axes or None, h_axes or None


def _spec_for(plan, name, b, h):
    """The PartitionSpec of `name` given the batch and head mesh axes."""
    dims = _dims(plan, name).replace("(j g)", "j").split()
    return P(*[b if d == "b" else h if d == "j" else None for d in dims])


def _partitioned(fn, plan, ins, outs):
    """custom_partitioning of fn(plan, *arrays) -> outputs over batch and heads."""
    from jax.experimental.custom_partitioning import custom_partitioning

    @custom_partitioning
    def call(*arrays):  # inside a jit: custom_partitioning takes no traced constants
        return jax.jit(fn, static_argnums=0)(plan, *arrays)

    def shardings(mesh, arg_shapes):
        b, h = _split(plan, mesh, arg_shapes[0].sharding.spec)
        named = lambda n: NamedSharding(mesh, _spec_for(plan, n, b, h))  # noqa: E731
        return tuple(named(n) for n in ins), tuple(named(n) for n in outs)

    def partition(mesh, arg_shapes, result_shape):
        args, results = shardings(mesh, arg_shapes)
        return mesh, lambda *a: fn(_local_plan(plan, ins, a), *a), results, args

    def infer(mesh, arg_shapes, result_shape):
        return shardings(mesh, arg_shapes)[1]

    rule, keep, sizes = _rule(plan, ins, outs)
    call.def_partition(partition, infer_sharding_from_operands=infer, sharding_rule=rule,
                       need_replication_factors=keep, **sizes)

    @jax.custom_batching.custom_vmap
    def batchable(*arrays):
        return call(*arrays)

    @batchable.def_vmap
    def unpartitioned(axis_size, in_batched, *arrays):  # vmap: the plain call, mapped
        axes = [0 if bt else None for bt in in_batched]
        out = jax.vmap(lambda *a: fn(plan, *a), in_axes=axes)(*arrays)
        return out, jax.tree.map(lambda _: True, out)

    return batchable


def partitions(platform, backend) -> bool:
    """Whether calls outside shard_map go through the batch/head partitioning rule:
    with more than one device, except the Triton interpreter on CPU, whose host
    callback segfaults in the separately built module of a custom_partitioning
    (jax 0.10.2); there XLA runs the callback on one device, as before."""
    return jax.device_count() > 1 and (platform != "triton" or backend == "gpu")


def batch_head_sharded(local, plan, inputs, cu_seqlens):
    """local(plan, inputs, cu_seqlens) -> (o, final) with a partitioning rule: inputs
    sharded over batch (not varlen) and heads stay where they are, each device computes
    its shard, outputs keep that sharding. `inputs`: the arrays of `bridge.contract.INPUTS`
    by name (absent ones None), batched layout. The backward is a second partitioned
    call that recomputes the forward (jax.vjp of `local`)."""
    import dataclasses

    arrays = dict(inputs, cu_seqlens=cu_seqlens)
    if plan.g_gamma == "head":  # per sequence, so its gradient never sums over devices
        arrays["g_gamma"] = jnp.broadcast_to(arrays["g_gamma"], (plan.N, plan.H))
        plan = dataclasses.replace(plan, g_gamma="seq")
    ins = tuple(n for n in ARGS if arrays[n] is not None)
    diff = tuple(n for n in ins if n != "cu_seqlens")

    def call(p, full):
        return local(p, {n: full.get(n) for n in INPUTS}, full.get("cu_seqlens"))

    def forward(p, *xs):
        return call(p, dict(zip(ins, xs)))

    def backward(p, *xs):
        full = dict(zip(ins, xs[:len(ins)]))
        do, dfin = xs[len(ins):]

        def f(*d):
            return call(p, dict(full, **dict(zip(diff, d))))

        _, vjp = jax.vjp(f, *(full[n] for n in diff))
        return vjp((do, dfin))

    fwd_call = _partitioned(forward, plan, ins, ("o", "final_state"))
    bwd_call = _partitioned(backward, plan, ins + ("o", "final_state"), diff)

    @jax.custom_vjp
    def run(*xs):
        return fwd_call(*xs)

    def run_fwd(*xs):
        return fwd_call(*xs), xs

    def run_bwd(xs, cts):
        grads = dict(zip(diff, bwd_call(*xs, *cts)))
        return tuple(grads.get(n) for n in ins)

    run.defvjp(run_fwd, run_bwd)
    o, final = run(*(arrays[n] for n in ins))
    return o, final
