"""The kit's three sizes (full, --quick, --dry-run): shapes, repeats and each step's time
cap, with the estimate each cap was set from.

A step's cap is enforced: its work runs in child processes that are killed (with their
own children) when it passes, and each is also given the step's deadline so it stops
starting measurements it cannot finish. The kit's whole budget bounds the sum: a step
starts with at most what is left of it.

Estimates for one H100 from a cold start (no Triton cache), from the first H100 session
(2026-11-24: tests/test_cuda.py ~3 min serially; fla's first backward autotune outran
minutes; our forward+backward ~55 ms at T=8192) and counts of compiles and calls:

  full (budget 480 s; caps sum to 465 s)
  machine      cap 30   est 12   torch+CUDA init ~5 s; 8192^3 bf16 matmul and a 1 GiB copy,
                                 do_bench 100 ms each
  correctness  cap 150  est 100  pytest -n 8 on tests/test_cuda.py: ~110 kernel variants
                                 compiled across 8 workers (~1.5 s each: ~25 s a worker),
                                 two Inductor compiles of a layer (~40 s each, in parallel),
                                 the (8,4096,16,128,128) test ~10 s. Meanwhile 8 fla
                                 precompile workers (~190 autotune configs, ~1.5 s each)
  speed        cap 195  est 150  fla's autotuner warmed alone on the GPU (cap 60, est 30:
                                 configs load from the cache, ~190 x 0.15 s benchmarks);
                                 torch child (cap 80, est 55): 4 impls x 3 T x 2 modes = 24
                                 do_bench (~0.5 s) + peak memory + per-launch times at
                                 T=4096 (~20 launches); JAX child (cap 70, est 50): 12 jit
                                 compiles (~2 s), 24 synced do_bench
  varlen       cap 45   est 20   64 sequences (~47k tokens): ours and fla fwd, fwd+bwd, and
                                 the sync check
  decode       cap 45   est 20   3 batches x 2 layers x (2 warm + 5 timed) runs of 64 steps

  quick (budget 180 s; caps sum to 175 s): T = 4096 only; pytest on the first case with
  the chunked kernels, the JAX-CPU, host-sync and bad-offsets tests (no Inductor
  compiles, no (8,4096) test); fla warm cap 25 s; launches at T = 1024; varlen and
  decode with fewer repeats.

  dry run (CPU, the interpreter, stand-ins): tiny shapes; caps generous for a loaded
  2-core machine, the whole run ~20-30 s.
"""

from dataclasses import dataclass, field

STEPS = ("machine", "correctness", "speed", "varlen", "decode")


@dataclass(frozen=True)
class Plan:
    name: str                 # "full", "quick" or "dry-run"
    device: str               # "cuda", or "cpu" for the dry run
    budget_s: float
    caps: dict                # step -> seconds
    estimates: dict           # step -> seconds (what the cap was set from)
    speed_caps: dict          # the speed step's children: fla_warm, torch, jax
    B: int = 8
    H: int = 16
    K: int = 128
    V: int = 128
    Ts: tuple = (1024, 4096, 8192)
    fla_T: int = 4096          # where fla's autotuner tunes (its keys leave T out)
    launch_T: int = 4096
    matmul_n: int = 8192
    copy_bytes: int = 2 ** 30
    warmup_ms: int = 25
    rep_ms: int = 250
    host_calls: int = 3
    pytest_args: tuple = ()
    fla_workers: int = 8
    jax_families: tuple = ("chunk", "fused_recurrent")
    launch_families: tuple = ("chunk", "fused_recurrent")
    varlen_seqs: int = 64
    varlen_lengths: tuple = (16, 4096)
    varlen_heads: tuple = (16, 128, 128)   # H, K, V
    decode_layer: tuple = (2048, 4)        # hidden size, heads (K = 256, V = 512)
    decode_batches: tuple = (1, 8, 64)
    decode_steps: int = 64
    decode_runs: int = 5
    stand_ins: tuple = field(default=())

    @property
    def dry(self) -> bool:
        return self.device != "cuda"


FULL = Plan(
    name="full", device="cuda", budget_s=480,
    caps=dict(machine=30, correctness=150, speed=195, varlen=45, decode=45),
    estimates=dict(machine=12, correctness=100, speed=150, varlen=20, decode=20),
    speed_caps=dict(fla_warm=60, torch=80, jax=70),
    pytest_args=("-n", "8", "--dist", "load"),
)

QUICK = Plan(
    name="quick", device="cuda", budget_s=180,
    caps=dict(machine=20, correctness=60, speed=65, varlen=15, decode=15),
    estimates=dict(machine=10, correctness=45, speed=50, varlen=10, decode=8),
    speed_caps=dict(fla_warm=25, torch=25, jax=25),
    Ts=(4096,), launch_T=1024, matmul_n=4096, copy_bytes=2 ** 28, rep_ms=100,
    pytest_args=("-n", "8", "--dist", "load", "-k",
                 "compiled_not or gla-chunks-chunk or committed or host_sync or bad_offsets"),
    decode_batches=(1, 64), decode_steps=32, decode_runs=3,
)

DRY = Plan(
    name="dry-run", device="cpu", budget_s=240,
    caps=dict(machine=40, correctness=60, speed=90, varlen=40, decode=40),
    estimates=dict(machine=1, correctness=5, speed=12, varlen=3, decode=2),
    speed_caps=dict(fla_warm=20, torch=40, jax=40),
    B=1, H=1, K=16, V=16, Ts=(16,), fla_T=16, launch_T=16, matmul_n=128,
    copy_bytes=2 ** 22, warmup_ms=1, rep_ms=1, host_calls=1, fla_workers=1,
    # the interpreted chunked backward costs seconds even here: JAX and the per-launch
    # times take the fused family only (the same code, another family name)
    jax_families=("fused_recurrent",), launch_families=("fused_recurrent",),
    varlen_seqs=2, varlen_lengths=(2, 9), varlen_heads=(1, 16, 16),
    decode_layer=(32, 2), decode_batches=(1, 2), decode_steps=2, decode_runs=1,
    stand_ins=(
        "device: the CPU (fp32 matmul and copy rates of this machine, not a GPU's)",
        "kernels: Triton's interpreter at tiny shapes, each timed once by a host clock; the "
        "JAX launch and the per-launch times for the fused family only",
        "fla chunk_gla: gla-bridge's torch-native chunked path (platform='torch')",
        "fla fused_recurrent_gla: a plain per-step torch loop",
        "fla's autotuner warm-up: processes that warm nothing (fla's kernels need CUDA)",
        "host-sync check: the contract's offsets check on offsets posing as CUDA "
        "(host reads raise), not torch.cuda.set_sync_debug_mode",
        "peak device memory: not measured (no CUDA allocator)",
    ),
)


def get(quick=False, dry=False) -> Plan:
    return DRY if dry else QUICK if quick else FULL
