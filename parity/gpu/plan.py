"""The kit's three sizes (full, --quick, --dry-run): shapes, repeats and each step's time
cap, with the estimate each cap was set from.

A step's cap is enforced: its work runs in child processes that are killed (with their
own children) when it passes, and each is also given the step's deadline so it stops
starting measurements it cannot finish. The kit's whole budget bounds the sum: a step
starts with at most what is left of it.

Estimates for one H100 from a cold start (no Triton cache), from the first H100 session
(2026-11-24: tests/test_cuda.py took ~3 min serially; fla's first backward autotune
outran minutes; our forward+backward ~55 ms at T=8192) and counts of compiles and calls
(a Triton compile of one of these kernels: ~1.5-3 s of one CPU core; 16 cores):

  full: budget 480 s, caps sum to 450 s (30 s for starting processes and writing)
  machine      cap 25   est 12   CUDA init ~5 s; an 8192^3 bf16 matmul and a 1 GiB copy,
                                 do_bench 100 ms each
  correctness  cap 150  est 110  pytest -n 6 on tests/test_cuda.py (28 tests): ~110 kernel
                                 variants over 6 workers (~40 s a worker), two Inductor
                                 compiles of a layer (~40-60 s each, started first), the
                                 (8,4096,16,128,128) test ~10 s. Beside it (ahead.py):
                                 4 workers compile the ~45 variants of ours the later steps
                                 time (~35 s a worker), 6 compile fla's ~190 autotune
                                 configs (~60-90 s a worker)
  speed        cap 210  est 150  what is left of those compiles, then fla's autotuning
                                 alone on the GPU (cap 70, est 40: ~190 configs load from
                                 the cache and run ~0.2 s each); torch child (cap 75,
                                 est 45): 4 impls x 3 T x 2 modes = 24 do_bench of ~0.5-1 s
                                 + one call each for peak memory + ~20 launches at T=4096;
                                 JAX child (cap 65, est 50): 12 XLA compiles (~2 s) and 24
                                 synchronized do_bench
  varlen       cap 35   est 15   ~47k tokens: 3 impls x 2 modes, each: a sync check (2
                                 calls), do_bench, a call for memory
  decode       cap 30   est 12   3 batches x 2 layers x (2 warm-up + 5 timed) runs of 64
                                 steps (~0.1-0.3 ms a step: launch-bound)

  quick: budget 180 s, caps sum to 175 s. T = 4096 only; pytest on the first case's
  chunked kernels, the JAX-CPU, host-sync and bad-offsets tests (no Inductor compile, no
  (8,4096) test: est 50 s); fla's tuning cap 25 s, so fla's rows may say "not warmed";
  launches at T = 1024; decode at batch 1 and 64, fewer runs.

  dry run (the CPU, the interpreter, stand-ins): tiny shapes; caps generous for a loaded
  2-core machine; the whole run ~25-40 s there.
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
    speed_caps: dict          # the speed step's children: fla_tune, torch, jax
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
    ahead_workers: int = 4                 # parity/gpu/ahead.py: ours, fla's configs
    fla_workers: int = 6
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
    caps=dict(machine=25, correctness=150, speed=210, varlen=35, decode=30),
    estimates=dict(machine=12, correctness=110, speed=150, varlen=15, decode=12),
    speed_caps=dict(fla_tune=70, torch=75, jax=65),
    pytest_args=("-n", "6", "--dist", "load"),
)

QUICK = Plan(
    name="quick", device="cuda", budget_s=180,
    caps=dict(machine=15, correctness=60, speed=75, varlen=15, decode=10),
    estimates=dict(machine=10, correctness=50, speed=60, varlen=10, decode=6),
    speed_caps=dict(fla_tune=25, torch=25, jax=25),
    Ts=(4096,), launch_T=1024, matmul_n=4096, copy_bytes=2 ** 28, rep_ms=100,
    pytest_args=("-n", "6", "--dist", "load", "-k",
                 "compiled_not or gla-chunks-chunk or committed or host_sync or bad_offsets"),
    decode_batches=(1, 64), decode_steps=32, decode_runs=3,
)

DRY = Plan(
    name="dry-run", device="cpu", budget_s=240,
    caps=dict(machine=40, correctness=60, speed=90, varlen=40, decode=40),
    estimates=dict(machine=1, correctness=5, speed=12, varlen=3, decode=2),
    speed_caps=dict(fla_tune=20, torch=40, jax=40),
    B=1, H=1, K=16, V=16, Ts=(16,), fla_T=16, launch_T=16, matmul_n=128,
    copy_bytes=2 ** 22, warmup_ms=1, rep_ms=1, host_calls=1, ahead_workers=1, fla_workers=1,
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
        "compiling and tuning ahead: processes that compile and tune nothing (the "
        "interpreter compiles nothing; fla's stand-ins have no autotuner)",
        "host-sync check: the contract's offsets check on offsets posing as CUDA "
        "(host reads raise), not torch.cuda.set_sync_debug_mode",
        "peak device memory: not measured (no CUDA allocator)",
    ),
)


def get(quick=False, dry=False) -> Plan:
    return DRY if dry else QUICK if quick else FULL
