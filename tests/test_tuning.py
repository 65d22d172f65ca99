"""The device table of launch configs (bridge/tuning.py) and the config sweep's candidates.

Checked: the launch lists take a table entry when the device matches (a device key
faked) and their own defaults otherwise (another device, the CPU); a knob a site does
not have is refused; a merged table file is read back; every candidate tiling of the
sweep list gives the float64 oracle's outputs and gradients in Triton's interpreter;
the candidates build ahead of time for sm_80 and sm_90 (a sample per site: the first
launch its largest, and its smallest, warps, stages and tiles change)."""

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import bridge.kernels  # noqa: E402,F401  (decides the interpreter before triton is imported)
from bridge import contract, grads, torch_runner, tuning  # noqa: E402
from parity.compiled import report  # noqa: E402
from bridge.kernels import family  # noqa: E402
from parity import backends, cases  # noqa: E402
from parity.compare import assert_close, errors  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REF = (8, 4096, 16, 128, 128)
FAKE = "9.0 Fake GPU"


@pytest.fixture
def fake_table(monkeypatch):
    """The shipped table replaced by one naming FAKE with two chunk entries and one
    fused entry for (bf16, K=V=128, key gate)."""
    plan = report.report_plan(REF, "bf16", "key")
    entries = {tuning.entry_key(plan, "chunk", "chunk_dqk_kernel"):
               dict(num_warps=8, num_stages=3, BK=64),
               tuning.entry_key(plan, "chunk", "chunk_state_kernel"): dict(num_stages=3),
               tuning.entry_key(plan, "fused_recurrent", "tiles"): dict(BV=64)}
    monkeypatch.setattr(tuning, "_shipped", lambda: {FAKE: {"source": "test",
                                                            "entries": entries}})
    return plan


def _by_kernel(launches):
    return {launch.kernel.__name__: launch for launch in launches}


def test_launch_lists_read_the_table_on_its_device(fake_table):
    plan = fake_table
    chunk, fused = family("chunk"), family("fused_recurrent")
    default = _by_kernel(chunk.backward_launches(plan, True))
    with tuning.on_device(FAKE):
        tuned = _by_kernel(chunk.backward_launches(plan, True))
        fused_tuned = fused.backward_launches(plan, True)
    assert (default["chunk_dqk_kernel"].num_warps, default["chunk_dqk_kernel"].num_stages,
            default["chunk_dqk_kernel"].constexprs["BK"]) == (4, 1, chunk.DQK_BK)
    dqk = tuned["chunk_dqk_kernel"]
    assert (dqk.num_warps, dqk.num_stages, dqk.constexprs["BK"]) == (8, 3, 64)
    assert dqk.grid[1] == 128 // 64  # the grid follows the tile
    assert dqk.constexprs["BV"] == default["chunk_dqk_kernel"].constexprs["BV"]  # not in entry
    assert tuned["chunk_state_kernel"].num_stages == 3
    assert tuned["chunk_state_kernel"].num_warps == default["chunk_state_kernel"].num_warps
    assert tuned["chunk_dv_kernel"] == default["chunk_dv_kernel"]  # no entry: defaults
    assert {launch.constexprs["BV"] for launch in fused_tuned[:2]} == {64}
    assert fused_tuned[0].grid[0] == 2 * plan.N * plan.H  # NV = 128 / 64
    # another device, another dtype, the CPU: the defaults
    for device, p in (("8.0 Other GPU", plan), (FAKE, report.report_plan(REF, "fp16", "key")),
                      (None, plan)):
        with tuning.on_device(device):
            other = _by_kernel(chunk.backward_launches(p, True))
        assert other["chunk_dqk_kernel"] == _by_kernel(chunk.backward_launches(p, True))[
            "chunk_dqk_kernel"]
        assert other["chunk_dqk_kernel"].num_stages == 1


def test_a_knob_the_site_lacks_is_refused(fake_table):
    with tuning.overriding({("chunk", "chunk_gate_kernel"): dict(BK=16)}):
        with pytest.raises(ValueError, match="chunk/chunk_gate_kernel has no knob"):
            family("chunk").forward_launches(fake_table)


def test_mode_auto_takes_the_devices_ranking(monkeypatch):
    """The ranking entry (bridge.dispatch.RANKING) sets mode="auto" on its device, for its
    kind of call, from its shortest length up: each call takes the family of the longest
    measured length <= its own; elsewhere the cost rule (dispatch.cost_choice) decides."""
    from bridge import dispatch

    plan = lambda T, **kw: report.report_plan((8, T, 16, 128, 128), **kw)  # noqa: E731
    key = tuning.entry_key(plan(4096), *dispatch.RANKING)
    assert key == "auto/mode/bfloat16/K128/V128/g=key"
    ranking = {key: {"T": [1024, 4096], "fastest": ["chunk", "fused_chunk"]}}
    monkeypatch.setattr(tuning, "_shipped", lambda: {FAKE: {"source": "test",
                                                            "entries": ranking}})
    want = {32: "fused_recurrent", 512: "chunk", 1024: "chunk", 4095: "chunk",
            4096: "fused_chunk", 8192: "fused_chunk"}
    for T, fam in want.items():
        with tuning.on_device(FAKE):
            assert dispatch.kernel_mode("auto", plan(T)) == fam, T
            assert dispatch.kernel_mode("chunk", plan(T)) == "chunk"  # a named mode stays
            other = plan(T, gates="head")  # another kind of call: the cost rule
            assert dispatch.kernel_mode("auto", other) == dispatch.cost_choice(other)
        for device in (None, "8.0 Other GPU"):  # the CPU, another device: the cost rule
            with tuning.on_device(device):
                assert dispatch.kernel_mode("auto", plan(T)) == dispatch.cost_choice(plan(T))
    # varlen calls are ranked by their mean length, as the cost rule counts them
    q = torch.zeros(1, 8192, 16, 128, dtype=torch.bfloat16)
    cu = torch.tensor([0, 4096, 8192])
    with tuning.on_device(FAKE):
        call = dispatch.prepare(dict(q=q, k=q, v=q, g=q), softmax_scale=None, reverse=False,
                                cu_seqlens=cu, platform="triton", mode="auto",
                                platforms=("auto", "triton", "torch"), fallback="torch",
                                gpu=False)
    assert (call.platform, call.kernel) == ("triton", "fused_chunk")
    # a ranked family that refuses the call's head dims: the cost rule
    wide = report.report_plan((8, 4096, 16, 1024, 128))
    ranking[tuning.entry_key(wide, *dispatch.RANKING)] = {"T": [1024], "fastest": ["fused_chunk"]}
    with tuning.on_device(FAKE):
        assert dispatch.kernel_mode("auto", wide) == dispatch.cost_choice(wide)


def test_merged_table_file_reads_back(tmp_path):
    table = tmp_path / "t.json"
    table.write_text(json.dumps({"schema": tuning.SCHEMA, "devices": {}}))
    new = tmp_path / "new.json"
    new.write_text(json.dumps(tuning.table_of(FAKE, "kit run", {"chunk/x": {"num_warps": 8}})))
    subprocess.run([sys.executable, "-m", "bridge.tuning", "--table", str(table), "--merge",
                    str(new)], cwd=ROOT, check=True, capture_output=True)
    assert tuning.load(str(table))["devices"][FAKE]["entries"] == {"chunk/x": {"num_warps": 8}}
    assert tuning.load()["devices"] == {} or all(  # the shipped table is well formed
        "entries" in d for d in tuning.load()["devices"].values())
    with pytest.raises(ValueError, match="not a tuning table"):
        new.write_text("{}")
        tuning.load(str(new))


def test_candidates_cover_each_site_with_defaults_first():
    plan = report.report_plan(REF, "bf16", "key")
    for mode in ("chunk", "fused_recurrent"):
        sites = tuning.sites(plan, mode)
        cands = tuning.candidates(plan, mode)
        assert {(f, s) for f, s, _ in cands} == set(sites)
        for key, defaults in sites.items():
            mine = [k for f, s, k in cands if (f, s) == key]
            assert mine[0] == defaults and len(mine) == len({json.dumps(k) for k in mine})
        quick = tuning.candidates(plan, mode, quick=True)
        assert len(quick) < len(cands) and {(f, s) for f, s, _ in quick} == set(sites)
    dqk = [k for _, s, k in tuning.candidates(plan, "chunk") if s == "chunk_dqk_kernel"]
    assert {k["BK"] for k in dqk} == {16, 32, 64} and {k["num_stages"] for k in dqk} == {1, 2, 3}


SMALL = {"chunk": cases.Case("tiles", B=1, T=80, H=1, Hk=1, K=128, V=128, g="key"),
         "fused_recurrent": cases.Case("tiles", B=1, T=6, H=1, Hk=1, K=128, V=128, g="key"),
         "fused_chunk": cases.Case("tiles", B=1, T=40, H=1, Hk=1, K=128, V=128, g="key")}
GATES = {"key": {}, "all": dict(gk=True, gv=True, g_gamma="head")}  # parity.compiled's GATES


def _signature(launches) -> str:
    """What the interpreter runs of a launch list (warps and stages change nothing there)."""
    return repr([(ln.kernel.__name__, ln.grid, sorted(ln.constexprs.items()))
                 for ln in launches])


def _tilings(plan, mode):
    """One candidate per distinct set of launches the interpreter would run (warps and
    stages change nothing there): [(site, knobs)]."""
    fam, seen, out = family(mode), set(), []
    for f, site, knobs in tuning.candidates(plan, mode):
        with tuning.overriding({(f, site): knobs}):
            launches = fam.forward_launches(plan) + fam.backward_launches(plan, True,
                                                                          fam.kept(plan))
        sig = _signature(launches)
        if sig not in seen:
            seen.add(sig)
            out.append((site, knobs))
    return out


@pytest.mark.parametrize("mode,gates", [("chunk", "key"), ("chunk", "all"),
                                        ("fused_recurrent", "key"), ("fused_recurrent", "all"),
                                        ("fused_chunk", "key")])
def test_every_candidate_tiling_matches_the_oracle(mode, gates):
    """Each tiling of the sweep's list at the reference shape's K = V = 128, bf16, with
    the key gate and with every gate (the sweep's two gate sets; fused_chunk's backward
    sites only exist without gv: the key gate), forward and backward (chunk: T = 80, two
    chunks, the second partial; fused_chunk: T = 40, two forward chunks and three
    backward ones, the last partial)."""
    case = SMALL[mode].with_(**GATES[gates])
    arrays = backends.prepared(case, "bfloat16", 0)
    want = backends.Oracle().run(case, arrays, "bfloat16")
    t = cases.to_torch(arrays, torch.bfloat16)
    env0 = dict(cases.call_kwargs(case, t))
    plan = contract.check(**env0)
    fam = family(mode)
    tilings = _tilings(plan, mode)
    assert len(tilings) >= {"chunk": 8, "fused_recurrent": 4, "fused_chunk": 2}[mode]
    forwards = {}  # a backward site's tilings share the default forward's outputs
    for site, knobs in tilings:
        with tuning.overriding({(mode, site): knobs}):
            fwd = fam.forward_launches(plan)
            bwd = fam.backward_launches(plan, True, fam.kept(plan))
        sig = _signature(fwd)
        if sig not in forwards:
            forwards[sig] = dict(env0, do=t["do"], dfinal_state=t["dfinal_state"])
            torch_runner.run(fwd, forwards[sig])
        env = {n: x.clone() if torch.is_tensor(x) else x for n, x in forwards[sig].items()}
        torch_runner.run(bwd, env)
        got = {"o": env["o"], "final_state": env["final_state"]}
        got.update({"d" + n: x for n, x in grads.assemble(plan, env).items()})
        errs = errors({n: x.float().numpy() for n, x in got.items()}, want)
        try:
            assert_close(errs, "bfloat16")
        except AssertionError as e:
            raise AssertionError(f"{mode} {gates} {site} {knobs}: {e}") from None


BUILD = """
import json, sys
from bridge import tuning
from parity.compiled import build, report
from bridge.kernels import family
plan = report.report_plan((8, 4096, 16, 128, 128), "bf16", "key")
done = []
for mode in ("chunk", "fused_recurrent", "fused_chunk"):
    fam = family(mode)
    by_site = {}
    for f, site, knobs in tuning.candidates(plan, mode):
        by_site.setdefault(site, []).append(knobs)
    for site, ks in by_site.items():
        # the largest and the smallest of every knob at once
        for pick in (max, min):
            knobs = {k: pick(x[k] for x in ks) for k in ks[0]}
            with tuning.overriding({(mode, site): knobs}):
                ls = fam.forward_launches(plan) + fam.backward_launches(plan, True, fam.kept(plan))
            dtypes = build.tensor_dtypes(plan, [ls])
            default = fam.forward_launches(plan) + fam.backward_launches(plan, True,
                                                                         fam.kept(plan))
            # the first launch the knobs change (none: fused_chunk's split off a GPU)
            launch = next((x for x, d in zip(ls, default) if x != d), None)
            if launch is None:
                continue
            for arch in (80, 90):
                build.compile_launch(launch, plan, arch, dtypes=dtypes)
                done.append((mode, site, launch.kernel.__name__, arch))
print(json.dumps(sorted(set(done))))
"""


@pytest.mark.matrix
def test_candidates_build_ahead_of_time_for_sm80_and_sm90(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path / "cache"))
    res = subprocess.run([sys.executable, "-c", BUILD], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=1800)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    done = json.loads(res.stdout.strip().splitlines()[-1])
    sites = {(m, s) for m in ("chunk", "fused_recurrent", "fused_chunk")
             for (_, s) in tuning.sites(report.report_plan(REF, "bf16", "key"), m)}
    # fused_chunk's split needs an SM count (a GPU) to change a launch: its kernels are the
    # forward's, built by the matrix
    assert {(m, s) for m, s, _, _ in done} == sites - {("fused_chunk", "split")}
    assert {a for *_, a in done} == {80, 90}
