"""The kit's three sizes (full, --quick, --dry-run): shapes, repeats and each step's time
cap, with the estimate each cap was set from.

A step's cap is enforced: its work runs in child processes that are killed (with their
own children) when it passes, and each is also given the step's deadline so it stops
starting measurements it cannot finish. The kit's whole budget bounds the sum: a step
starts with at most what is left of it.

Estimates for one H100 or H200 from a cold start (no Triton cache), from the first
full runs (2026-11-24 on an H100: tests/test_cuda.py ~3 min serially, fla's first
backward autotune minutes; 2026-11-27 on an H200: fla's first forward+backward at
T=4096 took 264 s compiling and tuning in one process; the kit's full run 177 s) and
counts of compiles and calls (a Triton compile of one of these kernels: ~1.5-3 s of
one CPU core; 16 cores):

  full: budget 600 s, caps sum to 580 s (20 s for starting processes and writing)
  machine      cap 25   est 12   CUDA init ~5 s; an 8192^3 bf16 matmul and a 1 GiB copy
  correctness  cap 190  est 150  pytest -n 6 on tests/test_cuda.py: ~110 kernel variants
                                 over 6 workers, two Inductor compiles of a layer; then the
                                 property tests of the 6 compiled Triton launches, 40 s of
                                 draws each (property_s; one worker each, ~40 s of wall
                                 beyond test_cuda.py, plus the example running when the
                                 time ends). Beside it (ahead.py): 4 workers compile ours
                                 (the ~45 variants the timed steps run, then the sweep's
                                 ~290 candidates, ~2 s each), 6 compile fla's ~190
                                 autotune configs (~60-90 s a worker)
  tune         cap 60   est 40   what is left of those compiles (40 s further along than
                                 before the property tests lengthened the correctness
                                 step: the compiles' window, correctness + tune - reserve,
                                 is unchanged at 205 s), then fla's autotuning alone on
                                 the GPU (~190 configs, cached: ~0.2 s each); nothing with
                                 --fla-configs
  speed        cap 110  est 80   ours from torch (cap 45), fla (cap 30), ours from JAX
                                 (cap 35): 3 T x 2 modes per implementation
  varlen       cap 30   est 15   ~47k tokens: 3 impls x 2 modes
  decode       cap 25   est 12   3 batches x 2 layers x (2 warm-up + 5 timed) runs
  kernels      cap 40   est 20   one profiled forward+backward per implementation
  sweep        cap 100  est 70   ~290 candidates (two gate sets, every family), each
                                 launch timed once warm (compiled ahead)

  quick: budget 180 s. T = 4096 only; pytest on the first case's chunked kernels (no
  Inductor compile, no property tests); fla's tuning cap 20 s, so fla's rows may say
  "not_warmed" (pass --fla-configs from a full run); decode at batch 1 and 64; the sweep
  with one knob changed at a time, key gate only.

  dry run (the CPU, the interpreter, stand-ins): tiny shapes; caps generous for a loaded
  2-core machine.
"""

from dataclasses import dataclass, field

STEPS = ("machine", "correctness", "tune", "speed", "varlen", "decode", "kernels", "sweep")
# the Triton families the speed, kernels and sweep steps cover (a new one: add its mode)
FAMILIES = ("chunk", "fused_recurrent", "fused_chunk")


@dataclass(frozen=True)
class Plan:
    name: str                 # "full", "quick" or "dry-run"
    device: str               # "cuda", or "cpu" for the dry run
    budget_s: float
    caps: dict                # step -> seconds
    estimates: dict           # step -> seconds (what the cap was set from)
    speed_caps: dict          # the speed step's children: ours, fla, jax
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
    property_s: int = 0        # seconds of hypothesis draws per compiled launch (0: none)
    ahead_workers: int = 4                 # parity/gpu/ahead.py: ours, fla's configs
    fla_workers: int = 6
    jax_families: tuple = FAMILIES
    launch_families: tuple = FAMILIES     # the per-launch times and the sweep
    varlen_seqs: int = 64
    varlen_lengths: tuple = (16, 4096)
    varlen_heads: tuple = (16, 128, 128)   # H, K, V
    decode_layer: tuple = (2048, 4)        # hidden size, heads (K = 256, V = 512)
    decode_batches: tuple = (1, 8, 64)
    decode_steps: int = 64
    decode_runs: int = 5
    profile_T: int = 4096      # the kernels step's forward+backward
    sweep_T: int = 4096
    sweep_gates: tuple = ("key", "all")
    sweep_quick: bool = False  # one knob changed at a time (bridge.tuning.candidates)
    sweep_rep_ms: int = 20
    tune_reserve_s: int = 45   # of the tune step's cap, kept for tuning after the compiles
    fla: str = "present"       # "absent": as if fla-core were not installed (--inject)
    faults: tuple = ()         # the dry run's stand-in faults (module doc of standins)
    stand_ins: tuple = field(default=())

    @property
    def dry(self) -> bool:
        return self.device != "cuda"


FULL = Plan(
    name="full", device="cuda", budget_s=600,
    caps=dict(machine=25, correctness=190, tune=60, speed=110, varlen=30, decode=25,
              kernels=40, sweep=100),
    estimates=dict(machine=12, correctness=150, tune=40, speed=80, varlen=15, decode=12,
                   kernels=20, sweep=70),
    speed_caps=dict(ours=45, fla=30, jax=35),
    pytest_args=("-n", "6", "--dist", "load"), property_s=40,
)

QUICK = Plan(
    name="quick", device="cuda", budget_s=180,
    caps=dict(machine=12, correctness=50, tune=20, speed=40, varlen=12, decode=8, kernels=12,
              sweep=20),
    estimates=dict(machine=10, correctness=45, tune=15, speed=30, varlen=8, decode=5, kernels=8,
                   sweep=15),
    speed_caps=dict(ours=15, fla=10, jax=15), tune_reserve_s=10,
    sweep_gates=("key",), sweep_quick=True, sweep_rep_ms=10,
    Ts=(4096,), launch_T=1024, matmul_n=4096, copy_bytes=2 ** 28, rep_ms=100,
    pytest_args=("-n", "6", "--dist", "load", "-k",
                 "compiled_not or gla-chunks-chunk or committed or host_sync or bad_offsets"),
    decode_batches=(1, 64), decode_steps=32, decode_runs=3,
)

DRY = Plan(
    name="dry-run", device="cpu", budget_s=480,
    caps=dict(machine=40, correctness=60, tune=40, speed=90, varlen=40, decode=40, kernels=60,
              sweep=120),
    estimates=dict(machine=1, correctness=5, tune=3, speed=12, varlen=3, decode=2, kernels=5,
                   sweep=30),
    speed_caps=dict(ours=40, fla=30, jax=40), tune_reserve_s=20,
    B=1, H=1, K=16, V=16, Ts=(16,), fla_T=16, launch_T=16, matmul_n=128, profile_T=16,
    sweep_T=16, sweep_gates=("key",), sweep_quick=True, sweep_rep_ms=1,
    copy_bytes=2 ** 22, warmup_ms=1, rep_ms=1, host_calls=1, ahead_workers=1, fla_workers=1,
    # the interpreted chunked backward costs seconds even here: JAX and the per-launch
    # times take the fused family only (the same code, another family name)
    jax_families=("fused_recurrent",), launch_families=("fused_recurrent",),
    property_s=2,  # collected and skipped here (no CUDA): the command carries them
    varlen_seqs=2, varlen_lengths=(2, 9), varlen_heads=(1, 16, 16),
    decode_layer=(32, 2), decode_batches=(1, 2), decode_steps=2, decode_runs=1,
    faults=("failing-impl", "fla-cold-decode"),
    stand_ins=(
        "device: the CPU (fp32 matmul and copy rates of this machine, not a GPU's)",
        "kernels: Triton's interpreter at tiny shapes, each timed once by a host clock; the "
        "JAX launch and the per-launch times for the fused family only",
        "fla chunk_gla: gla-bridge's torch-native chunked path (platform='torch')",
        "fla fused_recurrent_gla: a plain per-step torch loop",
        "compiling and tuning ahead: the interpreter compiles nothing; fla's stand-ins "
        "each run a tiny Triton kernel under triton.autotune (timed by the host clock), so "
        "tuning, writing and loading the winners and refusing to tune run as with fla",
        "host-sync check: the contract's offsets check on offsets posing as CUDA "
        "(host reads raise), not torch.cuda.set_sync_debug_mode",
        "peak device memory: not measured (no CUDA allocator)",
        "faults: an implementation that always fails is timed beside the others in the "
        "speed, varlen and decode steps; fla's tuning skips the decode step's calls, so "
        "fla's decode rows are not warmed",
        "per-kernel times: each launch of ours timed alone by a host clock (no profiler's "
        "device activity); fla's stand-ins launch no kernels of fla's; the instruction "
        "model's figures are the committed AOT report's at the reference shape",
        "config sweep: the fused family's candidates, fp32, key gate, one knob at a time, "
        "each launch timed once by a host clock; the device table written is the CPU's "
        "(never shipped)",
    ),
)


def get(quick=False, dry=False) -> Plan:
    return DRY if dry else QUICK if quick else FULL
