"""One benchmark module per framework, each in a child process of its own (as the CPU
sweep does: a process that has run XLA times torch differently).

The module runs as `python -m MODULE FRAMEWORK OUT.json [--quick]` and writes a JSON list.
"""

import json
import os
import subprocess
import sys
import tempfile


def per_framework(module, log=print, quick=False, frameworks=("torch", "jax")) -> list:
    """The concatenated lists of every framework's child; {"framework", "error"} for a
    child that failed."""
    out = []
    for framework in frameworks:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "out.json")
            cmd = [sys.executable, "-m", module, framework, path] + (["--quick"] if quick else [])
            log(f"{module}: {framework}")
            proc = subprocess.run(cmd)
            if proc.returncode != 0 or not os.path.exists(path):
                out.append({"framework": framework, "error": f"exit {proc.returncode}"})
                continue
            with open(path) as f:
                out += json.load(f)
    return out


def child_main(measure, argv=None):
    """A child's entry point: `FRAMEWORK OUT.json [--quick]` -> measure(framework, quick)
    written to OUT.json."""
    args = list(sys.argv[1:] if argv is None else argv)
    quick = "--quick" in args
    framework, out = [a for a in args if a != "--quick"]
    with open(out, "w") as f:
        json.dump(measure(framework, quick), f)
