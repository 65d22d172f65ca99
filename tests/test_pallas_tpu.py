"""The Pallas path as a TPU would get it, checked on this CPU host: the public
functions exported for platform "tpu" lower the Mosaic kernels (not the
interpreter), their Mosaic modules feed the MXU bf16 operands in >= 64-row
products, every launch carries a cost estimate that covers its MXU work, and
the blocks fit the default scoped VMEM. (Mosaic's final compile happens only on
a TPU; `jax.export` runs everything before it.)"""

import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

import jax_side  # noqa: E402
from jax_side import pallas, tpu_report  # noqa: E402
from parity import cases  # noqa: E402
from parity.compare import TOLERANCE, rel_err  # noqa: E402
from parity.oracle import recurrent as oracle  # noqa: E402

REF = (1, 1024, 4, 128, 128)  # B, T, H, K, V
KERNELS = {False: 1, True: 3}  # forward: one launch; fwd+bwd: forward with states + 2


def _fn(name, varlen):
    """The public function on its arrays; with `varlen` the last argument is cu_seqlens."""
    def f(*a):
        if varlen:
            return tpu_report.call(name, *a[:-1], cu_seqlens=a[-1])
        return tpu_report.call(name, *a)
    return f


def _export(f, args, platform, grad):
    def loss(*x):
        o, s = f(*x)
        return o.astype(jnp.float32).sum() + s.sum()

    floats = tuple(i for i, x in enumerate(args) if x.dtype != jnp.int32)
    g = (lambda *a: jax.grad(loss, floats)(*a)) if grad else f
    return jax.export.export(jax.jit(g), platforms=[platform])(*args).mlir_module()


@pytest.mark.parametrize("name, dtype, varlen", [
    ("recurrent", jnp.float32, False), ("recurrent", jnp.bfloat16, True),
    ("recurrent_gla", jnp.bfloat16, False), ("recurrent_gla", jnp.float32, True),
    ("lightning_attn", jnp.float32, False), ("lightning_attn", jnp.bfloat16, True),
])
def test_public_functions_lower_mosaic_for_tpu(name, dtype, varlen):
    """platform="pallas" through the public API, traced cu_seqlens or not: the export
    for "tpu" holds one Mosaic custom call per kernel and none of the interpreter's
    grid loops (one `while` per kernel in the CPU lowering of the same function)."""
    shape = (1, 192, 2, 64, 64)
    args = tpu_report._args(name, shape, dtype)
    if varlen:
        args.append(jax.ShapeDtypeStruct((4,), jnp.int32))
    f = _fn(name, varlen)
    for grad in (False, True):
        tpu = _export(f, args, "tpu", grad)
        cpu = _export(f, args, "cpu", grad)
        assert tpu.count("tpu_custom_call") == KERNELS[grad]
        assert "tpu_custom_call" not in cpu
        assert tpu.count("stablehlo.while") == cpu.count("stablehlo.while") - KERNELS[grad]


def test_public_function_runs_on_cpu_unchanged():
    """The same jitted public function that exports Mosaic runs the interpreter here."""
    _, x = cases.make(T=70, gk=True)
    q, k, v, gk = (x[n] for n in ("q", "k", "v", "gk"))
    f = jax.jit(lambda *a: jax_side.recurrent_gla(*a, platform="pallas"))
    o, s = f(q, k, v, gk)
    wo, ws = oracle(q, k, v, gk=gk)
    assert rel_err(o, wo) < TOLERANCE["float32"] and rel_err(s, ws) < TOLERANCE["float32"]
    assert "tpu_custom_call" in _export(lambda *a: jax_side.recurrent_gla(*a, platform="pallas"),
                                        [jax.ShapeDtypeStruct(x.shape, x.dtype)
                                         for x in (q, k, v, gk)], "tpu", False)


@pytest.fixture(scope="module")
def reference_reports():
    return {name: tpu_report.report(name, REF, "bf16") for name in tpu_report.FNS}


@pytest.mark.parametrize("name", list(tpu_report.FNS))
def test_mxu_bf16_operands_and_rows(reference_reports, name):
    """bf16 at (1,1024,4,128,128): of the tpu.matmul ops in the Mosaic modules (forward,
    and forward + backward), at least half take bf16 operands and at least half
    produce >= 64 rows."""
    rep = reference_reports[name]
    for pname, p in rep["passes"].items():
        assert p["tpu_custom_calls"] == KERNELS[pname == "fwd+bwd"]
        ops = sum(r["matmuls"] for r in p["launches"])
        assert ops > 0
        assert 2 * sum(r["bf16_matmuls"] for r in p["launches"]) >= ops, (pname, p["launches"])
        assert 2 * sum(r["rows64_matmuls"] for r in p["launches"]) >= ops, (pname, p["launches"])


@pytest.mark.parametrize("name", list(tpu_report.FNS))
def test_cost_estimates_and_vmem(reference_reports, name):
    """Every launch's CostEstimate covers the MXU FLOPs read from its Mosaic module
    (and is within 3x of them), reads at least its inputs, and its double-buffered
    blocks and scratch fit the 16 MiB default scoped VMEM at K = V = 128."""
    B, T, H, K, V = REF
    for p in reference_reports[name]["passes"].values():
        for r in p["launches"]:
            mxu = r["mxu_flops"]["bf16"] + r["mxu_flops"]["f32"]
            assert mxu <= r["flops"] <= 3 * mxu, r
            assert r["bytes_accessed"] >= 3 * B * T * H * K * 2, r
            assert r["transcendentals"] >= B * T * H, r  # at least one decay per token
            assert r["vmem_bytes"] < 16 * 2**20, r
            assert tuple(r["grid"])[:2] == (B, H) and r["grid"][3] == T // pallas.CHUNK, r


def test_fp32_inputs_take_fp32_products():
    """fp32 inputs keep fp32 MXU operands (at HIGHEST): no bf16 product anywhere."""
    _, text, _ = tpu_report.export("recurrent_gla", (1, 128, 2, 128, 128), jnp.float32)
    ops = [o for ops in tpu_report.matmuls(text).values() for o in ops]
    assert ops and all(o[1] == o[3] == "f32" for o in ops)


def test_readiness_section_renders_the_reports(reference_reports):
    """BENCHMARKS.md's TPU section states the counts of the reports it is given."""
    from parity.bench import readiness

    reps = list(reference_reports.values())
    text = readiness.tpu_section({"tpu": reps})
    assert "no TPU timing exists" in text
    for rep in reps:
        fb = rep["passes"]["fwd+bwd"]["launches"]
        n = sum(r["matmuls"] for r in fb)
        nb = sum(r["bf16_matmuls"] for r in fb)
        assert f"| {rep['fn']} |" in text and f"| {n} ({nb} / " in text
    assert readiness.tpu_section(None).startswith("not generated")
