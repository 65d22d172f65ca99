"""Run one function on P gloo ranks of torch.distributed: P spawned processes on this
machine, one CPU thread each (the CPU context-parallel tests and
`python -m parity --multi-device`)."""

import os
import sys
import tempfile
import time


def gloo(body, world, *args, timeout_s=300):
    """body(rank, world, *args) in `world` spawned processes that form one gloo group
    (the default group; file rendezvous in a temporary folder). `body` must be
    importable by name (a module-level function). Raises the first rank's error, or
    TimeoutError after timeout_s (the ranks are then killed, not left hanging)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(_rank, args=(world, os.path.join(tmp, "rendezvous"), body, args),
                                 nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=2):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"{world} gloo ranks running {body.__name__}: no result "
                                   f"in {timeout_s} s")


def _rank(rank, world, init_file, body, args):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        body(rank, world, *args)
        dist.barrier()  # no rank tears its connections down while another still uses them
    finally:
        dist.destroy_process_group()
    # done: leave without interpreter finalization, where torch 2.13's gloo threads
    # sometimes abort ("terminate called without an active exception"; bridge/SPEC.md, "Context
    # parallelism over torch.distributed")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
