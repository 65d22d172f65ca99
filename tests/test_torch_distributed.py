"""Context parallelism over torch.distributed (`context_group=`), against the
single-process call: 2 and 4 gloo ranks on CPU, spawned by the test, every case run in
one spawn (process start-up dominates). Each rank computes the single-process reference
itself on the whole inputs, then its slice with the group, and compares the forward,
the final state (the same on every rank) and every gradient: token inputs slice by slice,
inputs every rank holds whole (initial_state, g_gamma) summed over the ranks. The final
state's cotangent differs per rank, so the gradients through it must add up."""

from functools import partial

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import numpy as np  # noqa: E402

from parity import cases, spawn  # noqa: E402

TIMEOUT_S = 240


def launch(body, world):
    """body(rank, world) on `world` gloo ranks (parity.spawn); fails on any rank's error
    or after TIMEOUT_S."""
    spawn.gloo(body, world, timeout_s=TIMEOUT_S)


def _close(name, got, want, rtol=2e-4, atol=2e-5):
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def _inputs(case, seed, dtype=torch.float32):
    """Whole inputs (every rank draws the same) in `dtype`, gates <= 0: (recurrent's
    tensors by name, do, dfinal_state)."""
    arrays = cases.cast(cases.inputs(case, seed), np.float64 if dtype == torch.float64
                        else np.float32)
    x = cases.to_torch(arrays)
    return x, x.pop("do"), x.pop("dfinal_state")


def _check_case(case, rank, world, group):
    from torch_side import ops

    spec = case["case"]
    x, w_o, w_f = _inputs(spec, case["seed"], case.get("dtype", torch.float32))
    w_fs = [w_f * (r + 1) for r in range(world)]  # each rank's final-state cotangent
    kw = dict(reverse=spec.reverse, cu_seqlens=x.pop("cu_seqlens", None),
              platform=case["platform"])

    # the single-process reference on the whole inputs
    ref = {n: t.clone().requires_grad_() for n, t in x.items()}
    o, f = ops.recurrent(**ref, **kw)
    ((o * w_o).sum() + sum((f * w).sum() for w in w_fs)).backward()

    # this rank's slice of the time axis
    tdim = 0 if spec.packed else 1
    whole = ("g_gamma", "initial_state")
    T_local = x["q"].shape[tdim] // world
    sl = slice(rank * T_local, (rank + 1) * T_local)
    part = lambda t: t[sl] if tdim == 0 else t[:, sl]
    mine = {n: (t if n in whole else part(t)).clone().requires_grad_() for n, t in x.items()}
    o_cp, f_cp = ops.recurrent(**mine, **kw, context_group=group)
    ((o_cp * part(w_o)).sum() + (f_cp * w_fs[rank]).sum()).backward()

    name = spec.name
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
    """Tiny cases (12 tokens a rank; 4 for Triton); the cu_seqlens ones have sequences
    spanning ranks, starting exactly at a slice edge, and empty."""
    tl = 12
    n = world * tl
    if world == 2:  # one sequence across the edge; one starting at it; empty ones
        span, edge = [0, 5, tl + 3, tl + 3, n - 1, n], [0, tl, tl, n - 2, n]
    else:  # one sequence over three ranks (the middle one holds no boundary)
        span, edge = [0, 5, tl + 3, tl + 3, n - 1, n], [0, 5, tl + 3, tl + 3, 2 * tl, n - 1, n]
    C = partial(cases.Case, B=2, T=n, H=2, Hk=1, K=8, V=6)
    lens = lambda cu: tuple(np.diff(cu))  # noqa: E731
    torch_cases = [
        dict(case=C("key gate, gv, initial state", g="key", gv=True, initial_state=True),
             seed=0),
        dict(case=C("reverse, head gate, gk, g_gamma", g="head", gk=True, g_gamma="head",
                    initial_state=True, reverse=True), seed=1),
        dict(case=C("no gates"), seed=2),
        dict(case=C("cu_seqlens spanning ranks", B=1, Hk=2, g="key", g_gamma="seq",
                    initial_state=True, seqlens=lens(span)), seed=3),
        dict(case=C("cu_seqlens reverse, packed", B=1, H=4, Hk=2, gk=True, gv=True,
                    initial_state=True, seqlens=lens(edge), packed=True, reverse=True), seed=4),
        dict(case=C("float64, every gate, cu_seqlens", B=1, g="key", gk=True, gv=True,
                    g_gamma="seq", initial_state=True, seqlens=lens(span)), seed=7,
             dtype=torch.float64),
    ]
    # the Triton kernels, interpreted: fused_recurrent for such short slices
    triton_cases = [
        dict(case=C("triton", B=1, T=4 * world, K=4, V=4, g="key", gv=True,
                    initial_state=True), seed=5),
        dict(case=C("triton cu_seqlens reverse", B=1, Hk=2, K=4, V=4, g="head",
                    g_gamma="head", initial_state=True, reverse=True,
                    seqlens=lens([0, 3, 4 * world - 2, 4 * world])), seed=6),
    ]
    out = [dict(c, platform="torch") for c in torch_cases]
    return out + [dict(c, platform="triton") for c in triton_cases] if world == 2 else out


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
def test_context_parallel_equals_one_process(world):
    launch(_context_worker, world)


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

    case = cases.Case(B=2 if cu is None else 1, T=8, H=4, Hk=2, K=4, V=4, g="head", gv=True,
                      g_gamma="seq", initial_state=True, packed=cu is not None,
                      seqlens=None if cu is None else tuple(np.diff(cu)))
    x, w_o, w_f = _inputs(case, seed)
    cu = x.pop("cu_seqlens", None)
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


def _dtensor_kept_case(mesh):
    """gla_bridge::fwd on head-sharded DTensors, the same inputs in mode "torch", then
    "chunk", then "torch": the kept output's global shape follows the mode ([B,0,H,0],
    chunk's A [B,T,H,64]: DTensor's sharding cache must not reuse one mode's for another)
    and A is the one-process A; the chunk call's gradients (its backward reusing the
    sharded A) equal one process's."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from torch_side import custom_ops, ops

    gen = torch.Generator().manual_seed(30)
    B, T, H, K = 2, 8, 4, 4
    x = dict(q=torch.randn(B, T, H, K, generator=gen), k=torch.randn(B, T, H, K, generator=gen),
             v=torch.randn(B, T, H, K, generator=gen), g=-torch.rand(B, T, H, K, generator=gen))
    dt = {n: distribute_tensor(t, mesh, [Shard(2)], src_data_rank=None).requires_grad_()
          for n, t in x.items()}
    rest = (None, None, None, None, None, 0.5, False)
    for mode, shape in (("torch", (B, 0, H, 0)), ("chunk", (B, T, H, 64)),
                        ("torch", (B, 0, H, 0))):
        kept = custom_ops.fwd(*dt.values(), *rest, mode)[2]
        assert tuple(kept.shape) == shape and kept.placements == (Shard(2),), (mode, kept)
        if mode == "chunk":
            _close("kept A", kept.full_tensor(), custom_ops.fwd(*x.values(), *rest, mode)[2])
    ref = {n: t.clone().requires_grad_() for n, t in x.items()}
    o, f = ops.recurrent(**ref, platform="triton", mode="chunk")
    want = torch.autograd.grad(o.sum() + f.square().sum(), list(ref.values()))
    o_dt, f_dt = ops.recurrent(**dt, platform="triton", mode="chunk")
    got = torch.autograd.grad(o_dt.sum() + f_dt.square().sum(), list(dt.values()))
    _close("chunk DTensor o", o_dt.full_tensor(), o.detach())
    for n, d, w in zip(dt, got, want):
        _close(f"chunk DTensor d{n}", d.full_tensor(), w)


def _dtensor_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    _dtensor_kept_case(mesh)
    for i, strategy in enumerate(("batch", "head", "time")):
        _dtensor_case(mesh, (strategy,), "torch", seed=10 + i)
    _dtensor_case(mesh, ("head",), "triton", seed=20)
    for i, strategy in enumerate(("head", "time")):  # packed, a sequence across ranks
        _dtensor_case(mesh, (strategy,), "torch", seed=21 + i, cu=[0, 3, 3, 7, 8])


def test_dtensor_batch_head_time_equal_one_process():
    launch(_dtensor_worker, 2)


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


def test_layer_trains_under_ddp_and_fsdp2_like_one_process():
    launch(_layer_worker, 2)
