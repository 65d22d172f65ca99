"""The same Triton kernels launched from JAX (a host callback into the Triton
interpreter on CPU, jax-triton on CUDA), against the oracle and against the
PyTorch launch, under jit, grad, vmap and checkpoint."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import jax.numpy as jnp  # noqa: E402

import jax_side  # noqa: E402
import torch_side  # noqa: E402
from parity import backends, cases, oracle  # noqa: E402
from parity.compare import errors, rel_err, tolerance  # noqa: E402

JAX = backends.JaxBackend("triton", "fused_recurrent")
TORCH = backends.TorchBackend("triton", "fused_recurrent")
ORACLE = backends.Oracle()
KW = dict(platform="triton", mode="fused_recurrent")

CHOSEN = [c for c in cases.FEATURES
          if c.name in ("g-head", "gamma-seq", "reverse", "varlen", "gqa", "everything",
                        "strong-gates")]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", CHOSEN, ids=lambda c: c.name)
def test_matches_oracle_and_torch_launch(case, dtype):
    arrays = backends.prepared(case, dtype)
    got = JAX.run(case, arrays, dtype)
    want = ORACLE.run(case, arrays, dtype)
    errs = errors(got, want, case.gate_grad_floor)
    assert max(errs.values()) <= tolerance(dtype), errs
    # one kernel, two launchers: the same inputs give the same numbers
    same = errors(got, TORCH.run(case, arrays, dtype))
    assert max(same.values()) == 0.0, same


def test_traced_cu_seqlens_and_g_gamma_one_compile():
    """cu_seqlens and g_gamma are primal arguments: traced under jit, so one
    compile serves every packing of the same total length and N."""
    case = cases.Case("packing", H=2, Hk=1, seqlens=(5, 7), g="key", g_gamma="seq",
                      packed=True)
    a = cases.inputs(case, seed=1)
    traces = []

    def f(q, k, v, g, g_gamma, cu):
        traces.append(1)
        return jax_side.recurrent(q, k, v, g=g, g_gamma=g_gamma, cu_seqlens=cu, **KW)

    f = jax.jit(f)
    for cu in (np.array([0, 5, 12], np.int32), np.array([0, 9, 12], np.int32)):
        o, s = f(a["q"], a["k"], a["v"], a["g"], a["g_gamma"], cu)
        want_o, want_s = oracle.recurrent(a["q"], a["k"], a["v"], g=a["g"],
                                          g_gamma=a["g_gamma"], cu_seqlens=cu)
        assert rel_err(o, want_o) < 2e-5 and rel_err(s, want_s) < 2e-5
    assert len(traces) == 1


def test_grad_through_traced_g_gamma():
    case = cases.Case("gamma", B=2, H=2, Hk=2, g_gamma="head", initial_state=True)
    a = cases.inputs(case, seed=2)

    def loss(g_gamma):
        o, s = jax_side.recurrent(a["q"], a["k"], a["v"], g_gamma=g_gamma,
                                  initial_state=a["initial_state"], **KW)
        return (o * a["do"]).sum() + (s * a["dfinal_state"]).sum()

    got = jax.jit(jax.grad(loss))(jnp.asarray(a["g_gamma"]))
    want = oracle.recurrent_grads(a["q"], a["k"], a["v"], g_gamma=a["g_gamma"],
                                  initial_state=a["initial_state"], do=a["do"],
                                  dfinal_state=a["dfinal_state"])["g_gamma"]
    assert rel_err(got, want) < 2e-5


def test_vmap_over_a_leading_axis():
    case = cases.Case("vmap", H=1, Hk=1, g="head", initial_state=True)
    batch = [cases.inputs(case, seed=s) for s in range(3)]
    stack = {n: np.stack([b[n] for b in batch]) for n in ("q", "k", "v", "g", "initial_state")}

    def f(q, k, v, g, h0):
        return jax_side.recurrent(q, k, v, g=g, initial_state=h0, **KW)

    o, s = jax.jit(jax.vmap(f))(*(stack[n] for n in ("q", "k", "v", "g", "initial_state")))
    for i, b in enumerate(batch):
        oi, si = f(*(b[n] for n in ("q", "k", "v", "g", "initial_state")))
        assert np.array_equal(o[i], oi) and np.array_equal(s[i], si)
    # and the gradient of a vmapped call equals the per-example gradients
    names = ("q", "k", "v", "g", "initial_state")
    per_example = jax.grad(lambda q, k, v, g, h0: f(q, k, v, g, h0)[0].sum())
    dq_v = jax.jit(jax.vmap(per_example))(*(stack[n] for n in names))
    for i, b in enumerate(batch):
        assert np.array_equal(dq_v[i], per_example(*(b[n] for n in names)))


@pytest.mark.parametrize("packed", [False, True], ids=["batched", "packed"])
@pytest.mark.parametrize("gamma_mapped", [False, True], ids=["gamma-shared", "gamma-mapped"])
def test_vmap_folds_into_one_launch(packed, gamma_mapped):
    """The vmap rule folds the mapped axis into the batch (packed: into the
    tokens, cu_seqlens shifted); values and every gradient equal the oracle's
    per example, with g_gamma [H] shared or mapped and cu_seqlens mapped."""
    case = cases.Case("fold", B=1 if packed else 2, H=2, Hk=1, g="key", g_gamma="head",
                      initial_state=True, seqlens=(3, 6) if packed else None, packed=packed)
    names = ("q", "k", "v", "g", "g_gamma", "initial_state")
    batch = [cases.inputs(case, seed=s) for s in range(3)]
    if packed:  # a different packing per mapped element, same total length
        for b, cu in zip(batch, ([0, 3, 9], [0, 7, 9], [0, 0, 9])):
            b["cu_seqlens"] = np.array(cu, np.int32)
    if not gamma_mapped:
        for b in batch:
            b["g_gamma"] = batch[0]["g_gamma"]
    stack = {n: np.stack([b[n] for b in batch]) for n in names}
    cu = np.stack([b["cu_seqlens"] for b in batch]) if packed else None

    def loss(q, k, v, g, g_gamma, h0, cu, do, dfs):
        o, s = jax_side.recurrent(q, k, v, g=g, g_gamma=g_gamma, initial_state=h0,
                                  cu_seqlens=cu, **KW)
        return (o * do).sum() + (s * dfs).sum(), (o, s)

    grad = jax.grad(loss, argnums=tuple(range(6)), has_aux=True)
    axes = (0, 0, 0, 0, 0 if gamma_mapped else None, 0, 0 if packed else None, 0, 0)
    args = [stack[n] for n in names]
    if not gamma_mapped:
        args[4] = batch[0]["g_gamma"]
    do = np.stack([b["do"] for b in batch])
    dfs = np.stack([b["dfinal_state"] for b in batch])
    got, (o, s) = jax.jit(jax.vmap(grad, in_axes=axes))(*args, cu, do, dfs)
    for i, b in enumerate(batch):
        kw = dict(g=b["g"], g_gamma=b["g_gamma"], initial_state=b["initial_state"],
                  cu_seqlens=b["cu_seqlens"] if packed else None)
        want_o, want_s = oracle.recurrent(b["q"], b["k"], b["v"], **kw)
        want = oracle.recurrent_grads(b["q"], b["k"], b["v"], do=b["do"],
                                      dfinal_state=b["dfinal_state"], **kw)
        assert rel_err(o[i], want_o) < 2e-5 and rel_err(s[i], want_s) < 2e-5
        for name, d in zip(names, got):
            assert rel_err(d[i], want[name]) < 2e-5, name


def test_nested_vmap():
    case = cases.Case("nested", B=1, H=1, Hk=1, g="head")
    batch = [[cases.inputs(case, seed=3 * i + j) for j in range(2)] for i in range(2)]
    names = ("q", "k", "v", "g")
    stack = {n: np.stack([np.stack([b[n] for b in row]) for row in batch]) for n in names}

    def f(q, k, v, g):
        return jax_side.recurrent(q, k, v, g=g, **KW)[0]

    o = jax.jit(jax.vmap(jax.vmap(f)))(*(stack[n] for n in names))
    for i, row in enumerate(batch):
        for j, b in enumerate(row):
            want, _ = oracle.recurrent(b["q"], b["k"], b["v"], g=b["g"])
            assert rel_err(o[i, j], want) < 2e-5


def test_checkpoint():
    case = cases.Case("remat", H=1, Hk=1, g="key")
    a = cases.inputs(case, seed=4)

    def loss(q):
        o, _ = jax_side.recurrent(q, a["k"], a["v"], g=a["g"], **KW)
        return (o * a["do"]).sum()

    plain = jax.grad(loss)(a["q"])
    remat = jax.jit(jax.grad(jax.checkpoint(loss)))(a["q"])
    assert np.array_equal(plain, remat)


def test_same_errors_as_torch():
    """Both frameworks share the contract, so bad input fails the same way."""
    q = np.zeros((1, 4, 3, 8), np.float32)
    k = np.zeros((1, 4, 2, 8), np.float32)
    v = np.zeros((1, 4, 2, 8), np.float32)
    messages = []
    for fw in (jax_side, torch_side):
        conv = (lambda x: x) if fw is jax_side else torch.from_numpy
        with pytest.raises(ValueError) as info:
            fw.recurrent(conv(q), conv(k), conv(v), **KW)
        messages.append(str(info.value))
    assert messages[0] == messages[1] and messages[0].startswith("k:")
    with pytest.raises(ValueError, match="^mode: 'fused_recurrent' is a Triton kernel"):
        jax_side.recurrent(q, k[:, :, :1], v[:, :, :1], platform="pallas",
                           mode="fused_recurrent")
    with pytest.raises(ValueError, match="^platform:"):
        jax_side.recurrent(q, k[:, :, :1], v[:, :, :1], platform="cuda")


@pytest.mark.parametrize("version", ["0.3.1", "0.4.0"])
def test_gpu_launch_speaks_both_jax_triton_apis(monkeypatch, version):
    """No GPU here: a stand-in for jax_triton records what the CUDA branch would
    pass. Floats must reach the kernel as fp32 under both APIs (0.3 types a
    Python float as fp64, 0.4 as fp32 and deprecates np.float32), and the output
    spec keyword changed name (out_shape -> out_type)."""
    from bridge.kernels import fused_recurrent
    from jax_side import triton_launch

    calls = []

    class FakeJT:
        __version__ = version

        @staticmethod
        def triton_call(*args, kernel, grid, num_warps, num_stages, **kw):
            spec_key = "out_type" if version.startswith("0.4") else "out_shape"
            specs = kw.pop(spec_key)
            calls.append((args, kernel, grid, kw))
            return [jnp.zeros(s.shape, s.dtype) for s in specs]

    monkeypatch.setattr(triton_launch, "jt", FakeJT)
    case = cases.Case("gpu-api", H=2, Hk=1, g="head")
    a = cases.inputs(case)
    from bridge import contract

    plan = contract.check(a["q"], a["k"], a["v"], g=a["g"])
    env = {n: jnp.asarray(a[n]) for n in ("q", "k", "v", "g")}
    launches = fused_recurrent.forward_launches(plan)
    out = triton_launch._run_gpu(launches, env, ("o", "final_state"))
    assert out["o"].shape == (plan.B, plan.T, plan.H, plan.V)
    (args, kernel, grid, kw), = calls
    launch = launches[0]
    assert kernel is launch.kernel and grid == launch.grid
    kinds = [kind for _, kind, _ in launch.arguments() if kind != "out"]
    assert len(args) == len(kinds)  # the outputs go by their specs
    scalars = [x for x, kind in zip(args, kinds) if kind == "scalar"]
    assert all(isinstance(x, jax.Array) for x, kind in zip(args, kinds) if kind == "in")
    floats = [s for s in scalars if isinstance(s, (float, np.floating))]
    assert floats, "the launch passes the scale as a float scalar"
    want = float if version.startswith("0.4") else np.float32
    assert all(type(s) is want for s in floats)
    assert {k: kw[k] for k in launch.constexprs} == launch.constexprs


# ---------------------------------------------------------------- mode="chunk"

CHUNK_CASES = [
    cases.Case("chunks-batched", B=2, T=100, H=2, Hk=1, K=8, V=12, g="key", gv=True,
               initial_state=True, reverse=True),
    cases.Case("chunks-varlen", H=2, Hk=1, K=8, V=8, seqlens=(0, 70, 30), g="head", gk=True,
               g_gamma="seq", initial_state=True, packed=True),
]


@pytest.mark.parametrize("case,dtype", [(CHUNK_CASES[0], "float32"), (CHUNK_CASES[1], "float32"),
                                        (CHUNK_CASES[0], "bfloat16")],
                         ids=["batched-fp32", "varlen-fp32", "batched-bf16"])
def test_chunk_matches_oracle_and_torch_launch(case, dtype):
    """The chunked kernels from JAX, across several 64-token chunks: the oracle's
    numbers, and bit for bit the PyTorch launch's."""
    arrays = backends.prepared(case, dtype)
    got = backends.JaxBackend("triton", "chunk").run(case, arrays, dtype)
    errs = errors(got, ORACLE.run(case, arrays, dtype), case.gate_grad_floor)
    assert max(errs.values()) <= tolerance(dtype), errs
    same = errors(got, backends.TorchBackend("triton", "chunk").run(case, arrays, dtype))
    assert max(same.values()) == 0.0, same


def test_chunk_grad_under_jit_with_traced_cu_seqlens():
    """jax.grad under jit of the chunked kernels with cu_seqlens traced: two
    packings of 140 tokens (sequences of 0 to 140, crossing chunks) share one
    trace, and every gradient matches the oracle."""
    case = cases.Case("traced", H=2, Hk=1, K=8, V=8, seqlens=(70, 70), g="key",
                      g_gamma="seq", initial_state=True, packed=True)
    a = cases.inputs(case, seed=3)
    names = ("q", "k", "v", "g", "g_gamma", "initial_state")
    traces = []

    def loss(q, k, v, g, g_gamma, h0, cu):
        traces.append(1)
        o, s = jax_side.recurrent(q, k, v, g=g, g_gamma=g_gamma, initial_state=h0,
                                  cu_seqlens=cu, platform="triton", mode="chunk")
        return (o * a["do"]).sum() + (s * a["dfinal_state"]).sum()

    grad = jax.jit(jax.grad(loss, argnums=tuple(range(6))))
    for cu in (np.array([0, 70, 140], np.int32), np.array([0, 0, 140], np.int32)):
        got = grad(*(a[n] for n in names), cu)
        want = oracle.recurrent_grads(a["q"], a["k"], a["v"], g=a["g"], g_gamma=a["g_gamma"],
                                      initial_state=a["initial_state"], cu_seqlens=cu,
                                      do=a["do"], dfinal_state=a["dfinal_state"])
        for n, x in zip(names, got):
            assert rel_err(x, want[n]) < 2e-5, (n, cu, rel_err(x, want[n]))
    assert len(traces) == 1


@pytest.mark.parametrize("preset", [None, "/tmp/gla-bridge-triton-cache"])
def test_import_keeps_the_triton_cache_dir(preset, tmp_path):
    """jax-triton 0.3 blanks TRITON_CACHE_DIR on import, after which every compile
    through Triton's own launcher (the torch ops) fails on a GPU (seen on an H100):
    importing jax_side must leave the variable as it found it. A fresh process, so
    the import really runs, with a stand-in jax_triton doing what 0.3.1 does."""
    import os
    import subprocess
    import sys

    (tmp_path / "jax_triton").mkdir()
    (tmp_path / "jax_triton" / "__init__.py").write_text(
        'import os\nos.environ["TRITON_CACHE_DIR"] = ""\n__version__ = "0.3.1"\n')
    code = ("import os, jax_side.triton_launch as t; assert t.jt.__version__ == '0.3.1'; "
            "print(repr(os.environ.get('TRITON_CACHE_DIR')))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_CACHE_DIR"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), os.getcwd(), env.get("PYTHONPATH", "")])
    if preset:
        env["TRITON_CACHE_DIR"] = preset
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == repr(preset)
