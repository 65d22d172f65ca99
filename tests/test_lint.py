"""The repository passes its linter (ruff, configured in pyproject.toml), and bridge/'s
framework-neutral modules import with neither torch nor JAX (bridge/__init__.py lists them)."""

import json
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

import bridge

ROOT = pathlib.Path(__file__).resolve().parents[1]
FRAMEWORKS = ("torch", "jax", "jaxlib", "flax", "jax_triton")


def test_ruff_passes():
    ruff = (shutil.which("ruff", path=str(pathlib.Path(sys.executable).parent))
            or shutil.which("ruff"))
    if ruff is None:
        pytest.skip("ruff is not installed (it comes with the test extra: "
                    "pip install -e '.[test]')")
    run = subprocess.run([ruff, "check", "--no-cache", "--output-format", "concise", "."],
                         cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def _listed():
    """(neutral, bound): the entries of bridge/ its docstring names on each side."""
    neutral, bound = bridge.__doc__.split("Framework-bound:")
    names = lambda text: set(re.findall(r"`([\w/]+(?:\.py|/))`", text))
    return names(neutral), names(bound)


def test_the_docstring_lists_every_file_of_bridge_once():
    entries = {p.name + ("/" if p.is_dir() else "") for p in (ROOT / "bridge").iterdir()
               if (p.suffix == ".py" and p.name != "__init__.py")
               or (p.is_dir() and (p / "__init__.py").exists())}
    neutral, bound = _listed()
    top = lambda names: {n for n in names if n != "__init__.py" and (ROOT / "bridge" / n).exists()}
    assert top(neutral) | top(bound) == entries
    assert not top(neutral) & top(bound)


def _import_blocked(modules):
    """{module: None or the ImportError's text} importing each in a fresh interpreter
    where every framework import fails."""
    script = (f"import json, sys\nfor name in {FRAMEWORKS!r}:\n    sys.modules[name] = None\n"
              "import importlib\nout = {}\n"
              f"for m in {sorted(modules)!r}:\n"
              "    try:\n        importlib.import_module(m)\n        out[m] = None\n"
              "    except ImportError as e:\n        out[m] = str(e)\n"
              "print(json.dumps(out))\n")
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


def _modules(entry):
    """The dotted module names of a docstring entry ('kernels/' is every file in it)."""
    path = ROOT / "bridge" / entry
    files = sorted(path.glob("*.py")) if entry.endswith("/") else [path]
    return [".".join(f.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            for f in files]


def test_neutral_modules_import_without_torch_or_jax_and_bound_ones_do_not():
    neutral, bound = _listed()
    neutral = [m for e in neutral if (ROOT / "bridge" / e).exists() for m in _modules(e)]
    bound = [m for e in bound if (ROOT / "bridge" / e).exists() for m in _modules(e)]
    got = _import_blocked(neutral + bound)
    assert {m: got[m] for m in neutral if got[m] is not None} == {}
    # the blocking works: a bound module fails, and for the framework's sake
    for m in bound:
        assert got[m] is not None and any(f in got[m] for f in FRAMEWORKS), (m, got[m])
