"""DTensor inputs to the gla_bridge ops (SPEC.md, "Context parallelism over torch.distributed").

Each mesh dimension of a call runs one of three strategies, read from how q is sharded
there: "batch" (Shard(0) of [B,T,H,*]), "head" (Shard(2)) or "replicate". Batch and head
shards are independent problems, so the custom op runs on each rank's shard with no
communication and its outputs come back in the same placement (o like q; the final state
Shard(0) for batch, Shard(1) for heads): `gla_bridge::fwd` through `register_sharding`,
its backward (whose list output register_sharding cannot describe) as a local map in
custom_ops. A time-sharded q (Shard(1), or Shard(0) of packed [total,H,K]) routes to the
context-parallel path (torch_side/context.py) over that mesh dimension's process group.
"""

import torch.distributed as dist

from bridge.contract import ARGS, PER_SEQUENCE, PER_TOKEN

if dist.is_available():
    from torch.distributed.tensor import DTensor, Replicate, Shard
else:  # a torch built without distributed: nothing is a DTensor
    DTensor = ()

# the op's kept buffer is placed by the name of the only one a family keeps, chunk's A
# (torch_side/triton_launch.kept); where a mode keeps nothing, its [B,0,H,0] stand-in too


def is_dtensor(x) -> bool:
    return isinstance(x, DTensor)


def placement(name, ndim, strategy, packed=False):
    """The placement of argument `name` (`ndim` dims) on a mesh dimension running
    `strategy` ("batch", "head", "time" or "replicate"); `packed`: token arguments come as
    [total, H, *] instead of [B, T, H, *]."""
    if name in PER_TOKEN:
        dim = {"batch": 0, "time": 1, "head": 2}.get(strategy)
        return Replicate() if dim is None else Shard(dim - packed)
    if strategy not in ("batch", "head") or name == "cu_seqlens":
        return Replicate()
    if name in PER_SEQUENCE:
        return Shard(0 if strategy == "batch" else 1)
    if name == "g_gamma":  # [H] or [N, H]
        if ndim == 1:
            return Replicate() if strategy == "batch" else Shard(0)
        return Shard(0 if strategy == "batch" else 1)
    raise ValueError(f"{name}: not an argument of the gla_bridge ops")


def strategies_of(q):
    """Per mesh dimension, the strategy that DTensor q's placement there means."""
    packed = q.dim() == 3
    names = {0: "time", 1: "head"} if packed else {0: "batch", 1: "time", 2: "head"}
    return [names.get(p.dim, "replicate") if isinstance(p, Shard) else "replicate"
            for p in q.placements]


def register_fwd_sharding(op):
    """Sharding strategies of gla_bridge::fwd (its arguments: ARGS, scale, reverse, mode;
    its outputs o, final_state and the kept buffer, token-shaped in every mode)."""
    from torch.distributed.tensor.experimental import register_sharding

    from . import torch_internals

    @register_sharding(op)
    def fwd_strategies(*args):
        tensors = args[:len(ARGS)]
        found = []
        for strategy in ("replicate", "batch", "head"):
            if strategy == "batch" and tensors[-1] is not None:
                continue  # cu_seqlens means B = 1: nothing to split
            ins = [None if x is None else placement(n, x.ndim, strategy)
                   for n, x in zip(ARGS, tensors)]
            outs = [placement("q", 4, strategy), placement("final_state", 4, strategy),
                    placement("A", 4, strategy)]
            found.append((outs, ins + [None] * (len(args) - len(ARGS))))
        return found

    # scale, reverse and mode (after ARGS) set the outputs' shapes and dtypes too
    torch_internals.shard_cache_keyed_from(op, len(ARGS))


def local_map(fn, like, named, outputs):
    """fn on this rank's shards: `named` ((name, DTensor or None) pairs) redistributed to
    the strategies of DTensor `like` (q) and made local; fn's results wrapped back as
    DTensors shaped and placed like `outputs` ((name, DTensor) pairs, one a result).
    The backward of gla_bridge::fwd on DTensors."""
    mesh, strategies = like.device_mesh, strategies_of(like)

    def local(n, x):
        if x is None:
            return None
        return x.redistribute(mesh, [placement(n, x.ndim, s) for s in strategies]).to_local()

    got = fn(*(local(n, x) for n, x in named))
    return [wrap(d, mesh, [placement(n, x.ndim, s) for s in strategies], x.shape)
            for d, (n, x) in zip(got, outputs)]


def promote(q, named):
    """With DTensor q: each plain tensor of `named` (a dict of the op's arguments) as the
    DTensor of its whole value in the placements q's strategies ask for (each rank takes
    its own shard, no communication); DTensors and None unchanged."""
    from torch.distributed.tensor import distribute_tensor

    if not is_dtensor(q):
        return named
    packed, strategies = q.dim() == 3, strategies_of(q)

    def up(n, x):
        if x is None or is_dtensor(x):
            return x
        want = [placement(n, x.dim(), s, packed) for s in strategies]
        return distribute_tensor(x, q.device_mesh, want, src_data_rank=None)

    return {n: up(n, x) for n, x in named.items()}


def time_sharded(q):
    """The mesh dimension over which DTensor q is sharded on time (dim 1 of [B,T,H,K],
    dim 0 of packed [total,H,K]), or None (not a DTensor, or not time-sharded)."""
    if not is_dtensor(q):
        return None
    tdim = 0 if q.dim() == 3 else 1
    for d, p in enumerate(q.placements):
        if isinstance(p, Shard) and p.dim == tdim:
            return d
    return None


def context_parallel_call(recurrent, mesh_dim, q, k, v, **kw):
    """`recurrent` with q sharded on time over `mesh_dim`: every input redistributed to
    the placements q's strategies ask for (plain tensors count as the whole value), the
    local shards run with context_group = that mesh dimension's group, outputs wrapped
    back: o in q's placements, the final state replicated over the time dimension."""
    from torch.distributed.tensor import Partial, distribute_tensor

    mesh, packed, strategies = q.device_mesh, q.dim() == 3, strategies_of(q)
    options = {n: kw.pop(n) for n in ("softmax_scale", "reverse", "platform", "mode")}

    def local(n, x):
        if x is None:
            return None
        want = [placement(n, x.dim(), s, packed) for s in strategies]
        if is_dtensor(x):
            # an input whole on every rank of the time dimension gets this rank's share
            # of its gradient there: Partial, summed when DTensor reduces it
            grad = [Partial() if s == "time" and n not in PER_TOKEN else p
                    for s, p in zip(strategies, want)]
            return x.redistribute(mesh, want).to_local(grad_placements=grad)
        # every rank holds the whole plain tensor: its own shard, no communication
        return distribute_tensor(x, mesh, want, src_data_rank=None).to_local()

    loc = {n: local(n, x) for n, x in dict(q=q, k=k, v=v, **kw).items()}
    group = mesh.get_group(mesh_dim)
    o, final = recurrent(**loc, **options, context_group=group)
    # the replicated final state's cotangent arrives whole on every rank; the exchange
    # adds the ranks' cotangents up, so each passes on its 1/P share (forward unchanged)
    final = final.detach() + (final - final.detach()) / dist.get_world_size(group)
    cu = kw.get("cu_seqlens")
    N = q.shape[0] if cu is None else cu.shape[0] - 1
    return (wrap(o, mesh, [placement("q", 4, s, packed) for s in strategies],
                 (*q.shape[:-1], v.shape[-1])),
            wrap(final, mesh, [placement("final_state", 4, s) for s in strategies],
                 (N, q.shape[-2], *final.shape[2:])))


def wrap(x, mesh, placements, shape):
    """Local shard x as the DTensor of global `shape` (contiguous) in `placements`."""
    stride = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        stride[i] = stride[i + 1] * shape[i + 1]
    return DTensor.from_local(x, mesh, placements, run_check=False, shape=tuple(shape),
                              stride=tuple(stride))
