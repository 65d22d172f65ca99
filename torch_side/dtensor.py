"""DTensor inputs to the gla_bridge ops (SPEC.md, "Context parallelism").
"""

import torch
import torch.distributed as dist

if dist.is_available():
    from torch.distributed.tensor import DTensor, Replicate, Shard
else:  # a torch built without distributed: nothing is a DTensor
    DTensor = ()


def time_sharded(q):
    """The mesh dimension over which DTensor q is sharded on time (dim 1 of [B,T,H,K],
    dim 0 of packed [total,H,K]), or None (not a DTensor, or not time-sharded)."""
    if not isinstance(q, DTensor):
        return None
    tdim = 0 if q.dim() == 3 else 1
    for d, p in enumerate(q.placements):
        if isinstance(p, Shard) and p.dim == tdim:
            return d
    return None
