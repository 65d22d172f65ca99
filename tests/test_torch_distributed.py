"""Context parallelism over torch.distributed (`context_group=`), against the
single-process call: 2 and 4 gloo ranks on CPU, spawned by the test, every case run in
one spawn (process start-up dominates). Each rank computes the single-process reference
itself on the whole inputs, then its slice with the group, and compares the forward,
the final state (the same on every rank) and every gradient: token inputs slice by slice,
inputs every rank holds whole (initial_state, g_gamma) summed over the ranks. The final
state's cotangent differs per rank, so the gradients through it must add up."""

import os
import sys
import time

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import torch.multiprocessing as mp  # noqa: E402

TIMEOUT_S = 240


def launch(body, world, tmp_path):
    """Run body(rank, world) on `world` gloo ranks; fail on any rank's error or after
    TIMEOUT_S (the ranks are then killed, not left hanging)."""
    init_file = str(tmp_path / "rendezvous")
    ctx = mp.start_processes(_rank_main, args=(world, init_file, body), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"{world} ranks did not finish in {TIMEOUT_S} s")


def _rank_main(rank, world, init_file, body):
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        body(rank, world)
        dist.barrier()  # no rank tears its connections down while another still uses them
    finally:
        dist.destroy_process_group()
    # done: leave without interpreter finalization, where torch 2.13's gloo threads
    # sometimes abort ("terminate called without an active exception"; README.md)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _close(name, got, want, rtol=2e-4, atol=2e-5):
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def _inputs(case, T, seed):
    """Whole inputs (every rank draws the same), float32 (or case["dtype"]), gates <= 0."""
    B, H, Hk, K, V = case["shape"]
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)
    gate = lambda *s: torch.nn.functional.logsigmoid(r(*s) + 2.0) * 0.5
    lead = (T,) if case.get("packed") else (B, T)
    x = dict(q=r(*lead, H, K), k=r(*lead, Hk, K), v=r(*lead, Hk, V))
    gates = case["gates"]
    if "g" in gates:
        x["g"] = gate(*lead, H, K)
    if "g_head" in gates:
        x["g"] = gate(*lead, H)
    if "gk" in gates:
        x["gk"] = gate(*lead, H, K)
    if "gv" in gates:
        x["gv"] = gate(*lead, H, V)
    N = B if case.get("cu") is None else len(case["cu"]) - 1
    if "g_gamma" in gates:
        x["g_gamma"] = -0.1 * torch.rand(H, generator=gen)
    if "g_gamma_seq" in gates:
        x["g_gamma"] = -0.1 * torch.rand(N, H, generator=gen)
    if case.get("h0"):
        x["initial_state"] = r(N, H, K, V)
    dt = case.get("dtype", torch.float32)
    return ({n: t.to(dt) for n, t in x.items()}, r(*lead, H, V).to(dt),
            r(N, H, K, V).to(dt))


def _check_case(case, rank, world, group):
    from torch_side import ops

    T = case["T_local"] * world
    x, w_o, w_f = _inputs(case, T, seed=case["seed"])
    w_fs = [w_f * (r + 1) for r in range(world)]  # each rank's final-state cotangent
    cu = None if case.get("cu") is None else torch.tensor(case["cu"], dtype=torch.int32)
    kw = dict(reverse=case.get("reverse", False), cu_seqlens=cu, platform=case["platform"])

    # the single-process reference on the whole inputs
    ref = {n: t.clone().requires_grad_() for n, t in x.items()}
    o, f = ops.recurrent(**ref, **kw)
    ((o * w_o).sum() + sum((f * w).sum() for w in w_fs)).backward()

    # this rank's slice of the time axis
    tdim = 0 if case.get("packed") else 1
    whole = ("g_gamma", "initial_state")
    sl = slice(rank * case["T_local"], (rank + 1) * case["T_local"])
    part = lambda t: t[sl] if tdim == 0 else t[:, sl]
    mine = {n: (t if n in whole else part(t)).clone().requires_grad_() for n, t in x.items()}
    o_cp, f_cp = ops.recurrent(**mine, **kw, context_group=group)
    ((o_cp * part(w_o)).sum() + (f_cp * w_fs[rank]).sum()).backward()

    name = case["name"]
    # float64 (the torch path computes in float64): the algorithm itself, to 1e-10
    tol = dict(rtol=1e-10, atol=1e-10) if case.get("dtype") == torch.float64 else {}
    _close(f"{name} o", o_cp, part(o.detach()), **tol)
    _close(f"{name} final_state", f_cp, f.detach(), **tol)
    for n, t in mine.items():
        grad = t.grad
        if n in whole:  # this rank's share: the shares add up to the whole gradient
            grad = grad.clone()
            dist.all_reduce(grad, group=group)
            want = ref[n].grad
        else:
            want = part(ref[n].grad)
        _close(f"{name} d{n}", grad, want, **tol)


def _cases(world):
    """Tiny cases; the cu_seqlens ones have sequences spanning ranks, starting exactly at
    a slice edge, and empty."""
    base = dict(shape=(2, 2, 1, 8, 6), T_local=12, platform="torch", seed=0)
    tl = 12
    n = world * tl
    if world == 2:  # one sequence across the edge; one starting at it; empty ones
        span, edge = [0, 5, tl + 3, tl + 3, n - 1, n], [0, tl, tl, n - 2, n]
    else:  # one sequence over three ranks (the middle one holds no boundary)
        span, edge = [0, 5, tl + 3, tl + 3, n - 1, n], [0, 5, tl + 3, tl + 3, 2 * tl, n - 1, n]
    cases = [
        dict(base, name="key gate, gv, initial state", gates=("g", "gv"), h0=True),
        dict(base, name="reverse, head gate, gk, g_gamma", gates=("g_head", "gk", "g_gamma"),
             h0=True, reverse=True, seed=1),
        dict(base, name="no gates", gates=(), seed=2),
        dict(base, name="cu_seqlens spanning ranks", shape=(1, 2, 2, 8, 6),
             gates=("g", "g_gamma_seq"), h0=True, cu=span, seed=3),
        dict(base, name="cu_seqlens reverse, packed", shape=(1, 4, 2, 8, 6), packed=True,
             gates=("gk", "gv"), h0=True, cu=edge, reverse=True, seed=4),
        dict(base, name="float64, every gate, cu_seqlens", shape=(1, 2, 1, 8, 6),
             gates=("g", "gk", "gv", "g_gamma_seq"), h0=True, cu=span, seed=7,
             dtype=torch.float64),
        # the Triton kernels, interpreted: fused_recurrent for such short slices
        dict(base, name="triton", shape=(1, 2, 1, 4, 4), T_local=4, platform="triton",
             gates=("g", "gv"), h0=True, seed=5),
        dict(base, name="triton cu_seqlens reverse", shape=(1, 2, 2, 4, 4), T_local=4,
             platform="triton", gates=("g_head", "g_gamma"), h0=True, reverse=True,
             cu=[0, 3, 4 * world - 2, 4 * world], seed=6),
    ]
    return cases if world == 2 else [c for c in cases if c["platform"] == "torch"]


def _check_errors(world, group):
    """cu_seqlens are the global offsets: ending at one slice's token count is an error,
    raised before any collective."""
    from torch_side import ops

    q = torch.randn(1, 4, 1, 2)
    with pytest.raises(ValueError, match=f"cu_seqlens: expected to end at the token count "
                                         f"{4 * world}"):
        ops.recurrent(q, q, q, cu_seqlens=torch.tensor([0, 4]), context_group=group)


def _context_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    _check_errors(world, dist.group.WORLD)
    for case in _cases(world):
        _check_case(case, rank, world, dist.group.WORLD)
    if world == 4:  # a 2 x 2 mesh: batch or heads on one dimension, time on the other
        mesh = init_device_mesh("cpu", (2, 2))
        _dtensor_case(mesh, ("batch", "time"), "torch", seed=30)
        _dtensor_case(mesh, ("time", "head"), "torch", seed=31)


@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_equals_one_process(world, tmp_path):
    launch(_context_worker, world, tmp_path)


def test_context_group_must_be_a_process_group():
    from torch_side import ops

    q = torch.randn(1, 4, 1, 2)
    with pytest.raises(TypeError, match="context_group: expected a torch.distributed"):
        ops.recurrent(q, q, q, context_group="world")


def _dtensor_case(mesh, strategies, platform, seed, cu=None):
    """DTensors sharded per mesh dimension on the batch (Shard(0)) or heads (Shard(2)):
    the op runs on each shard with no collective, outputs and gradients in the inputs'
    placements, equal to one process; on time (Shard(1)): the context-parallel path over
    that mesh dimension, the final state replicated there. With `cu`: packed inputs
    [total, H, *] (heads Shard(1), time Shard(0))."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    from torch_side import ops

    case = dict(shape=(2, 4, 2, 4, 4), gates=("g_head", "gv", "g_gamma_seq"), h0=True,
                seed=seed, packed=cu is not None, cu=cu)
    x, w_o, w_f = _inputs(case, 8, seed)
    cu = None if cu is None else torch.tensor(cu)
    ref = {n: t.clone().requires_grad_() for n, t in x.items()}
    o, f = ops.recurrent(**ref, cu_seqlens=cu, platform=platform)
    grads = torch.autograd.grad((o * w_o).sum() + (f * w_f).sum(), list(ref.values()))
    want = dict(zip(ref, grads))

    each = lambda table: [table[s] for s in strategies]
    lead = 0 if cu is None else 1  # packed: no batch axis
    tok = each({"batch": Shard(0), "head": Shard(2 - lead), "time": Shard(1 - lead)})
    state = each({"batch": Shard(0), "head": Shard(1), "time": Replicate()})
    place = dict(g_gamma=state, initial_state=state)  # g_gamma [N, H] like the state
    dt = {n: distribute_tensor(t, mesh, place.get(n, tok), src_data_rank=None)
          .requires_grad_() for n, t in x.items()}
    time = "time" in strategies
    with CommDebugMode() as comms:
        o_dt, f_dt = ops.recurrent(**dt, cu_seqlens=cu, platform=platform)
    assert time or comms.get_total_counts() == 0, comms.get_comm_counts()
    if time:  # the mesh dimension is the group: giving another is an error
        with pytest.raises(ValueError, match="context_group: a time-sharded DTensor"):
            ops.recurrent(**dt, cu_seqlens=cu, context_group=dist.group.WORLD)
    assert o_dt.placements == tuple(tok) and f_dt.placements == tuple(state), (o_dt, f_dt)
    do = distribute_tensor(w_o, mesh, tok, src_data_rank=None)
    dfin = distribute_tensor(w_f, mesh, state, src_data_rank=None)
    with CommDebugMode() as comms:
        got = torch.autograd.grad([o_dt, f_dt], list(dt.values()), [do, dfin])
    assert time or comms.get_total_counts() == 0, comms.get_comm_counts()
    name = f"DTensor {strategies} {platform}"
    _close(f"{name} o", o_dt.full_tensor(), o.detach())
    _close(f"{name} final_state", f_dt.full_tensor(), f.detach())
    for (n, t), d in zip(dt.items(), got):
        assert isinstance(d, DTensor) and d.placements == t.placements, (n, d)
        _close(f"{name} d{n}", d.full_tensor(), want[n])


def _dtensor_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    for i, strategy in enumerate(("batch", "head", "time")):
        _dtensor_case(mesh, (strategy,), "torch", seed=10 + i)
    _dtensor_case(mesh, ("head",), "triton", seed=20)
    for i, strategy in enumerate(("head", "time")):  # packed, a sequence across ranks
        _dtensor_case(mesh, (strategy,), "torch", seed=21 + i, cu=[0, 3, 3, 7, 8])


def test_dtensor_batch_head_time_equal_one_process(tmp_path):
    launch(_dtensor_worker, 2, tmp_path)


def _train(layer, x, y, steps, reduce_loss=None):
    """`steps` of SGD on the mean squared error; the loss before each step (averaged over
    the ranks by reduce_loss when given)."""
    opt = torch.optim.SGD(layer.parameters(), lr=0.5)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(layer(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach() if reduce_loss is None else reduce_loss(loss.detach()))
    return torch.stack(losses)


def _layer_worker(rank, world):
    """A GLA layer trained on one process, then wrapped in DDP: batch-parallel, and
    context-parallel (each rank a time slice, context_group=WORLD); FSDP2 fully_shard
    batch-parallel. Every run's losses (averaged over the ranks) equal the one-process
    losses step by step, and so do the trained weights."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from torch_side import GatedLinearAttention, LightningAttention

    def mean_over_ranks(t):
        t = t.clone()
        dist.all_reduce(t)
        return t / world

    B, T, D, steps = 4, 8, 16, 3
    gen = torch.Generator().manual_seed(7)
    x, y = torch.randn(B, T, D, generator=gen), torch.randn(B, T, D, generator=gen)
    kw = dict(hidden_size=D, num_heads=2, platform="torch")
    torch.manual_seed(0)
    one = GatedLinearAttention(**kw)
    start = {n: p.detach().clone() for n, p in one.state_dict().items()}
    want = _train(one, x, y, steps)
    assert want[-1] < want[0], want  # it trains

    b = slice(rank * B // world, (rank + 1) * B // world)
    t = slice(rank * T // world, (rank + 1) * T // world)

    def fresh(**extra):
        layer = GatedLinearAttention(**kw, **extra)
        layer.load_state_dict(start)
        return layer

    runs = {
        "DDP batch": (DDP(fresh()), x[b], y[b]),
        "DDP context": (DDP(fresh(context_group=dist.group.WORLD)), x[:, t], y[:, t]),
        "FSDP2 batch": (fully_shard(fresh()), x[b], y[b]),
    }
    for name, (model, xs, ys) in runs.items():
        got = _train(model, xs, ys, steps, mean_over_ranks)
        _close(f"{name} losses", got, want, rtol=1e-5, atol=1e-6)
        trained = {n.removeprefix("module."): p for n, p in model.state_dict().items()}
        for n, p in one.state_dict().items():
            p_got = trained[n].full_tensor() if hasattr(trained[n], "full_tensor") \
                else trained[n]
            _close(f"{name} {n}", p_got, p, rtol=1e-4, atol=1e-6)

    # the Lightning layer with a group: the same output as one process
    torch.manual_seed(1)
    light = LightningAttention(**kw, layer_idx=1, num_layers=2)
    cp = LightningAttention(**kw, layer_idx=1, num_layers=2,
                            context_group=dist.group.WORLD)
    cp.load_state_dict(light.state_dict())
    _close("Lightning context-parallel", cp(x[:, t]), light(x)[:, t].detach())


def test_layer_trains_under_ddp_and_fsdp2_like_one_process(tmp_path):
    launch(_layer_worker, 2, tmp_path)
