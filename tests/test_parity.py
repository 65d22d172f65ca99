"""`python -m parity`: it passes on this machine's backends, and it can fail."""

import json

import numpy as np
import pytest

from parity import __main__ as cli
from parity import backends, cases

QUICK = ("everything",)  # grouped heads, every gate kind, reverse, packed and empty sequences


def test_quick_matrix_passes(tmp_path, capsys):
    out = tmp_path / "parity.json"
    rc = cli.main(["--cases", ",".join(QUICK), "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    data = json.loads(out.read_text())
    assert data["rows"] and all(r["ok"] for r in data["rows"])
    assert "parity:" in text and " 0 failed" in text


class Perturbed(backends.Backend):
    """A backend that is wrong by a little: the oracle, with `o` off by 1e-3."""

    name, framework = "perturbed", "numpy"

    def run(self, case, arrays, dtype):
        out = backends.Oracle().run(case, arrays, dtype)
        out["o"] = out["o"] * (1 + 1e-3)
        return out


class DroppedGate(backends.Backend):
    """A backend that forgets the value-dim gate gv."""

    name, framework = "dropped-gv", "numpy"

    def run(self, case, arrays, dtype):
        return backends.Oracle().run(case.with_(gv=False),
                                     {n: a for n, a in arrays.items() if n != "gv"}, dtype)


class Crashing(backends.Backend):
    name, framework = "crashing", "numpy"

    def run(self, case, arrays, dtype):
        raise RuntimeError("kernel launch failed")


@pytest.mark.parametrize("wrong", [Perturbed(), DroppedGate(), Crashing()],
                         ids=lambda b: b.name)
def test_a_wrong_backend_is_reported(monkeypatch, capsys, wrong):
    monkeypatch.setattr(backends, "all_backends", lambda: [backends.Oracle(), wrong])
    rc = cli.main(["--cases", "gv,everything"])
    text = capsys.readouterr().out
    assert rc == 1
    assert f"MISMATCH gv float32 {wrong.name} vs oracle" in text


def test_pairwise_disagreement_is_reported():
    """Two backends that each pass against the oracle within tolerance but not
    with each other are caught by the pairwise comparison."""
    class Shifted(backends.Backend):
        framework = "numpy"

        def __init__(self, name, sign):
            self.name, self.sign = name, sign

        def run(self, case, arrays, dtype):
            out = backends.Oracle().run(case, arrays, dtype)
            out["o"] = out["o"] * (1 + self.sign * 1.5e-5)
            return out

    rows = cli.run([backends.Oracle(), Shifted("a", 1), Shifted("b", -1)],
                   [(cases.FEATURES[0], "float32")])
    by = {(r["backend"], r["against"]): r for r in rows}
    assert by[("a", "oracle")]["ok"] and by[("b", "oracle")]["ok"]
    assert not by[("a", "b")]["ok"]
    assert by[("a", "b")]["worst"] == pytest.approx(3e-5, rel=1e-3)


def test_usage_errors_exit_2():
    for argv in (["--backends", "nope"], ["--cases", "nope"], ["--quick", "--full"]):
        with pytest.raises(SystemExit) as info:
            cli.main(argv)
        assert info.value.code == 2


def test_inputs_are_rounded_before_everyone_sees_them():
    case = cases.FEATURES[0]
    a = backends.prepared(case, "bfloat16")
    import ml_dtypes

    assert np.array_equal(a["q"], a["q"].astype(ml_dtypes.bfloat16).astype(np.float32))
    assert a["g" if "g" in a else "dfinal_state"].dtype == np.float32
