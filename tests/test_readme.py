"""The README's Python examples run as written, and its test command is what CI runs."""

import pathlib
import re

import pytest

README = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
# "# many devices" blocks need 8 host devices: tests/test_jax_multidevice.py runs them
BLOCKS = [b for b in re.findall(r"```python\n(.*?)```", README, flags=re.S)
          if not b.startswith("# many devices")]


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_python_example_runs(index):
    pytest.importorskip("torch" if "torch_side" in BLOCKS[index] else "jax")
    exec(compile(BLOCKS[index], f"README.md python block {index}", "exec"), {})


def test_ci_runs_the_readme_test_command():
    ci = (pathlib.Path(__file__).parents[1] / ".ci" / "run").read_text()
    assert "<!-- ci:test -->" in README and "<!-- ci:test -->" in ci
    after = README.split("<!-- ci:test -->", 1)[1]
    command = re.search(r"```bash\n(.*?)\n```", after, flags=re.S).group(1)
    assert command.startswith("python3 -m venv") and "pytest" in command
