"""The `gla_bridge` custom ops (torch_side/custom_ops.py) under torch.library.opcheck,
torch.compile(fullgraph=True), torch.export, autocast and torch.func.vmap.

Every compiled or exported result is compared with the eager module (itself checked
against the float64 oracle in test_layers.py); the ops' own results with the oracle.
Tiny shapes, few compiles: this file runs on one xdist worker (--dist loadfile)."""

from functools import partial

import pytest
import torch

import bridge.kernels  # noqa: F401  (decides on Triton's interpreter before triton loads)
import torch_side
from parity import cases, oracle
from parity.compare import rel_err
from torch_side import GatedLinearAttention, LightningAttention, custom_ops

TOL = 2e-5  # float32 (parity/compare.py)
ARGS = cases.INPUTS


C = partial(cases.Case, B=2, T=5, H=2, Hk=2, K=4, V=3)
SPECS = {c.name: c for c in (
    C("gk", gk=True),
    C("g3d_gamma_seq_varlen", B=1, seqlens=(3, 4), g="head", g_gamma="seq"),
    C("gv_reverse_h0", gv=True, initial_state=True, reverse=True),
    C("grouped", H=4, Hk=2, g="key", g_gamma="head"),  # with the per-head g_gamma
)}
CASES = tuple(SPECS)


def _case(name, seed=None):
    """Inputs of gla_bridge::fwd in the batched layout: (tensors by name, cu_seqlens,
    reverse, {do, dfinal_state})."""
    seed = sum(map(ord, name)) if seed is None else seed
    t, cot = cases.split(cases.to_torch(cases.inputs(SPECS[name], seed)))
    return t, t.pop("cu_seqlens", None), SPECS[name].reverse, cot


OPCHECK = [(c, m) for c in CASES for m in ("torch", "fused_recurrent")] + [
    ("grouped", "chunk"), ("gk", "chunk")]
# The interpreted chunk backward costs ~15 s a call here and opcheck's autograd tests call
# it several times: chunk mode gets the schema and fake-tensor checks of the forward (the
# backward's fake and autograd registration are shared by every mode, checked above; its
# kernels by test_triton_chunk.py, its reuse of the kept A by test_triton_chunk_bwd.py).
# "grouped" (with g_gamma) keeps nothing, "gk" keeps A: the fake gives both shapes.
CHEAP = ("test_schema", "test_faketensor")


def _np(x):
    return None if x is None else x.detach().double().numpy()


@pytest.mark.parametrize("name,mode", OPCHECK)
def test_opcheck_and_oracle(name, mode):
    """opcheck (schema, fake tensors, autograd registration, aot_dispatch_dynamic) of both
    ops; their results against the float64 oracle."""
    t, cu, reverse, cot = _case(name)
    ins = [t.get(n) for n in ARGS]
    scale = 0.5
    fwd_args = [None if x is None else x.clone().requires_grad_() for x in ins]
    fwd_args += [cu, scale, reverse, mode]
    out = torch.library.opcheck(custom_ops.fwd, fwd_args,
                                **(dict(test_utils=CHEAP) if mode == "chunk" else {}))
    assert set(out.values()) == {"SUCCESS"}, out

    o, fin, kept = custom_ops.fwd(*ins, cu, scale, reverse, mode)
    np_ins = {n: _np(x) for n, x in zip(ARGS, ins) if x is not None}
    cu_np = None if cu is None else cu.numpy()
    o_ref, fin_ref = oracle.recurrent(**np_ins, softmax_scale=scale, reverse=reverse,
                                      cu_seqlens=cu_np)
    assert rel_err(o, o_ref) < TOL and rel_err(fin, fin_ref) < TOL
    B, T, H = ins[0].shape[:3]
    keeps_a = mode == "chunk" and t.get("g_gamma") is None
    assert kept.shape == ((B, T, H, 64) if keeps_a else (B, 0, H, 0)), kept.shape
    if mode == "chunk":
        return

    do, dfin = cot["do"], cot["dfinal_state"]
    bwd_args = [*ins, cu, fin, None, do, dfin, scale, reverse, mode]
    out = torch.library.opcheck(custom_ops.bwd, bwd_args, test_utils=CHEAP)
    assert set(out.values()) == {"SUCCESS"}, out
    got = custom_ops.bwd(*bwd_args)
    want = oracle.recurrent_grads(**np_ins, softmax_scale=scale, reverse=reverse,
                                  cu_seqlens=cu_np, do=do.numpy(), dfinal_state=dfin.numpy())
    names = [n for n, x in zip(ARGS, ins) if x is not None]
    errs = {n: rel_err(d, want[n]) for n, d in zip(names, got)}
    assert all(e < 1e-4 for e in errs.values()), errs


@pytest.mark.parametrize("name,mode", [("grouped", "fused_recurrent"), ("gk", "chunk")])
def test_triton_op_bodies_match_the_ops(name, mode):
    """The CUDA decomposition's triton_ops (launches through wrap_triton), run eagerly on
    CPU: the same results as gla_bridge::fwd / bwd, chunk's kept A included (passed to
    the backward as autograd does). (Their compiled path needs a GPU.)"""
    t, cu, reverse, _ = _case(name)
    ins = [t.get(n) for n in ARGS]
    want = custom_ops.fwd(*ins, cu, 0.5, reverse, mode)
    got = custom_ops.triton_fwd(*ins, cu, 0.5, reverse, mode)
    assert len(got) == 3 and all(torch.equal(a, b) for a, b in zip(got, want))
    kept = want[2] if mode == "chunk" else None
    bwd_args = [*ins, cu, want[1], kept, want[0], want[1], 0.5, reverse, mode]
    got, want = custom_ops.triton_bwd(*bwd_args), custom_ops.bwd(*bwd_args)
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))


# ---------------------------------------------------------------- layers under torch.compile
def _layer(cls, platform, seed=0):
    torch.manual_seed(seed)
    mode = "fused_recurrent" if platform == "triton" else "auto"
    kw = dict(num_kv_heads=1, gate_low_rank_dim=4) if cls is GatedLinearAttention else {}
    m = cls(hidden_size=16, num_heads=2, platform=platform, mode=mode, **kw)
    with torch.no_grad():
        m.g_norm.weight.uniform_(0.5, 1.5)
    return m


def _step(m):
    def step(x, state):
        o, s = m(x, state=state, use_cache=True)
        return o, s
    return step


def _fwd_bwd(fn, m, x, s0):
    """Outputs and every parameter's gradient (and the state's) of one forward+backward."""
    m.zero_grad()
    s0 = s0.clone().requires_grad_()
    o, s = fn(x, s0)
    ((o * torch.linspace(-1, 1, o.shape[-1])).sum() + s.square().sum()).backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    return o.detach(), s.detach(), grads, s0.grad


# inductor on the torch platform (the default CPU route); aot_eager elsewhere: the same
# dynamo graph and AOT forward/backward trace, without C++ builds (CI time)
@pytest.mark.parametrize("cls,platform,backend", [
    (GatedLinearAttention, "torch", "inductor"), (LightningAttention, "torch", "aot_eager"),
    (GatedLinearAttention, "triton", "aot_eager"), (LightningAttention, "triton", "aot_eager")],
    ids=lambda x: getattr(x, "__name__", x))
def test_compile_fullgraph_dynamic_T(cls, platform, backend):
    """No graph break; forward and backward equal eager; T marked dynamic: three sequence
    lengths, one compile (a recompile raises)."""
    torch._dynamo.reset()
    m = _layer(cls, platform)
    step = _step(m)
    gen = torch.Generator().manual_seed(3)
    s0 = torch.randn(*m.config.state_shape(2), generator=gen)
    x = torch.randn(2, 6, 16, generator=gen)
    assert torch._dynamo.explain(step)(x, s0).graph_break_count == 0
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    for i, T in enumerate((6, 9, 3)):
        x = torch.randn(2, T, 16, generator=gen)
        torch._dynamo.mark_dynamic(x, 1)
        with torch.compiler.set_stance("fail_on_recompile" if i else "default"):
            got = _fwd_bwd(compiled, m, x, s0)
        want = _fwd_bwd(step, m, x, s0)
        assert rel_err(got[0], want[0]) < TOL and rel_err(got[1], want[1]) < TOL
        assert rel_err(got[3], want[3]) < TOL
        errs = {n: rel_err(got[2][n], want[2][n]) for n in want[2]}
        assert all(e < TOL for e in errs.values()), errs
    torch._dynamo.reset()


def test_compile_packed_varlen():
    """Packed inputs with cu_seqlens: still one graph (the contract does not read traced
    cu_seqlens values), and the compiled forward and backward equal eager."""
    t, cu, _, _ = _case("g3d_gamma_seq_varlen")
    t = {n: x[0] if x.dim() > 2 and n != "initial_state" else x for n, x in t.items()}

    def f(q, k, v, g, g_gamma, cu):
        o, s = torch_side.recurrent(q, k, v, g=g, g_gamma=g_gamma, cu_seqlens=cu,
                                    platform="torch")
        return (o * o).sum() + s.sum()

    args = [t[n] for n in ("q", "k", "v", "g", "g_gamma")]
    assert torch._dynamo.explain(f)(*args, cu).graph_break_count == 0
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    leaves = [[x.clone().requires_grad_() for x in args] for _ in range(2)]
    loss, loss_ref = compiled(*leaves[0], cu), f(*leaves[1], cu)
    assert rel_err(loss.detach(), loss_ref.detach()) < TOL
    got, want = torch.autograd.grad(loss, leaves[0]), torch.autograd.grad(loss_ref, leaves[1])
    for a, b in zip(got, want):
        assert rel_err(a, b) < TOL
    # values the trace could not check are checked when the op runs, before any kernel
    with pytest.raises(ValueError, match="cu_seqlens"):
        compiled(*args, torch.tensor([0, 5, 3]))
    torch._dynamo.reset()


@pytest.mark.parametrize("platform", ["torch", "triton"])
@pytest.mark.parametrize("cls", [GatedLinearAttention, LightningAttention],
                         ids=lambda c: c.__name__)
def test_export_prefill_and_decode(cls, platform):
    """torch.export of the layer for a prefill and for one decode step with a state: the
    exported programs compute what the eager module does."""
    m = _layer(cls, platform, seed=4)
    gen = torch.Generator().manual_seed(5)
    x, x1 = torch.randn(2, 6, 16, generator=gen), torch.randn(2, 1, 16, generator=gen)
    prefill = torch.export.export(m, (x,), {"use_cache": True})
    with torch.no_grad():
        o, s = prefill.module()(x, use_cache=True)
        o_ref, s_ref = m(x, use_cache=True)
    assert rel_err(o, o_ref) < TOL and rel_err(s, s_ref) < TOL
    decode = torch.export.export(m, (x1,), {"state": s_ref, "use_cache": True})
    assert any("gla_bridge.fwd" in str(n.target) for n in decode.graph.nodes)
    with torch.no_grad():
        o1, s1 = decode.module()(x1, state=s_ref, use_cache=True)
        o1_ref, s1_ref = m(x1, state=s_ref, use_cache=True)
    assert rel_err(o1, o1_ref) < TOL and rel_err(s1, s1_ref) < TOL


# ---------------------------------------------------------------- autocast
@pytest.mark.parametrize("cls", [GatedLinearAttention, LightningAttention],
                         ids=lambda c: c.__name__)
def test_autocast_bf16_layer_forward_backward(cls):
    """autocast(cpu, bf16): the output is bf16, the state fp32, and the parameter
    gradients (fp32, the parameters' dtype) match the fp32 run within bf16 tolerance."""
    m = _layer(cls, "torch", seed=6)
    gen = torch.Generator().manual_seed(7)
    x, s0 = torch.randn(2, 8, 16, generator=gen), torch.randn(*m.config.state_shape(2))
    want = _fwd_bwd(_step(m), m, x, s0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o, s = _step(m)(x, s0)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    m.zero_grad()
    ((o.float() * torch.linspace(-1, 1, o.shape[-1])).sum() + s.square().sum()).backward()
    assert rel_err(o.detach().float(), want[0]) < 3e-2 and rel_err(s.detach(), want[1]) < 3e-2
    for n, p in m.named_parameters():
        assert p.grad.dtype == torch.float32
        assert rel_err(p.grad, want[2][n]) < 5e-2, n


def test_autocast_policy_on_the_op():
    """Under autocast, q/k/v reach the op in bf16 and gates and states in fp32 (the op's
    output and state show it); each input's gradient comes back in its own dtype."""
    t, _, _, _ = _case("gv_reverse_h0")
    t = {n: x.requires_grad_() for n, x in t.items()}
    t["gv"] = t["gv"].detach().bfloat16().requires_grad_()  # a bf16 gate goes up to fp32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o, s = torch_side.recurrent(**t, reverse=True, platform="torch")
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    (o.float().sum() + s.sum()).backward()
    for n, x in t.items():
        assert x.grad.dtype == x.dtype and x.grad.shape == x.shape, n
    # the same call with the policy applied by hand, outside autocast: identical
    ref = {n: x.detach() for n, x in t.items()}
    ref.update({n: ref[n].bfloat16() for n in ("q", "k", "v")}, gv=ref["gv"].float())
    o_ref, s_ref = torch_side.recurrent(**ref, reverse=True, platform="torch")
    assert torch.equal(o, o_ref) and torch.equal(s, s_ref)
    # and close to the float32 run
    o32, s32 = torch_side.recurrent(**{n: x.detach().float() for n, x in t.items()},
                                    reverse=True, platform="torch")
    assert rel_err(o.detach().float(), o32) < 3e-2 and rel_err(s.detach(), s32) < 3e-2


# ---------------------------------------------------------------- vmap
@pytest.mark.parametrize("name,extra", [("gk", ()), ("g3d_gamma_seq_varlen", ()),
                                        ("grouped", ()), ("grouped", ("g_gamma",)),
                                        ("gv_reverse_h0", ("initial_state",))])
def test_vmap_folds_into_the_batch(name, extra):
    """torch.func.vmap over a leading axis (q, k, v, the gate and `extra` mapped, the rest
    shared: a shared g_gamma [H] stays one row, a mapped one becomes one per sequence)
    equals a loop of calls."""
    t, cu, reverse, _ = _case(name)
    X = 3
    gate = {"gk": "gk", "gv_reverse_h0": "gv"}.get(name, "g")
    names = ("q", "k", "v", gate, *extra)
    mapped = {n: torch.stack([_case(name, seed=8 + i)[0][n] for i in range(X)]) for n in names}
    shared = {n: x for n, x in t.items() if n not in mapped}

    def f(*xs):
        return torch_side.recurrent(**dict(zip(names, xs)), **shared, reverse=reverse,
                                    cu_seqlens=cu, platform="torch")

    o, s = torch.func.vmap(f)(*(mapped[n] for n in names))
    for i in range(X):
        o_i, s_i = f(*(mapped[n][i] for n in names))
        assert rel_err(o[i], o_i) < TOL and rel_err(s[i], s_i) < TOL


def test_vmap_over_cu_seqlens_is_refused():
    t, cu, _, _ = _case("g3d_gamma_seq_varlen")
    cus = torch.stack([cu, torch.tensor([0, 5, 7])])
    f = lambda c: custom_ops.fwd(t["q"], t["k"], t["v"], t["g"], None, None, None, None, c,
                                 0.5, False, "torch")
    with pytest.raises(ValueError, match="cu_seqlens"):
        torch.func.vmap(f)(cus)
