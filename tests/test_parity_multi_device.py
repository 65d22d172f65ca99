"""`python -m parity --multi-device`: torch's context_group over 2 gloo ranks and JAX's
context_axis over 2 host devices, on the same inputs, against the float64 oracle and
each other (packed sequences spanning the two slices, reverse, per-sequence g_gamma,
initial state, every gradient)."""

import pytest

pytest.importorskip("torch")
pytest.importorskip("jax")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from parity import multi_device  # noqa: E402
from parity.__main__ import main  # noqa: E402


def test_torch_and_jax_context_parallel_agree():
    rows = multi_device.compare(P=2, names={"cp-varlen-reverse"})
    assert [label for _, label, *_ in rows] == [
        "torch-cp vs oracle", "jax-cp vs oracle", "torch-cp vs jax-cp"]
    assert all(ok for *_, ok in rows), rows


def test_usage_errors():
    with pytest.raises(SystemExit) as e:
        main(["--multi-device", "1"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main(["--multi-device", "--cases", "nope"])
    assert e.value.code == 2
