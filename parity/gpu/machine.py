"""Step "machine". Device, driver, CUDA, the versions of everything measured, and
the device's own ceilings (bf16 matmul rate, copy bandwidth), measured the way every
later figure is (`parity.bench.gpu.bench`)."""

import subprocess

from parity.bench import gpu


def _driver():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def run(emit, deadline, *, plan):
    import torch

    facts = {"versions": gpu.versions(), "torch_cuda": torch.version.cuda}
    if plan.dry:
        facts.update(device="CPU (stand-in for a GPU)", driver=None, sm_count=None,
                     l2_bytes=None, memory_bytes=None, capability=None)
    else:
        props = torch.cuda.get_device_properties(0)
        facts.update(device=props.name, driver=_driver(), sm_count=props.multi_processor_count,
                     l2_bytes=getattr(props, "L2_cache_size", None),
                     memory_bytes=props.total_memory,
                     capability=f"{props.major}.{props.minor}")
    emit("facts", **facts)
    tf, gb = gpu.ceilings(plan.device, plan.matmul_n, plan.copy_bytes)
    facts.update(matmul_tflops=tf, matmul_n=plan.matmul_n,
                 matmul_dtype="bfloat16" if not plan.dry else "float32", copy_gbps=gb,
                 copy_bytes=plan.copy_bytes)
    return facts
