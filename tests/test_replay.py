"""Replay mode: the traced model's shapes and times, and a short replay at P=2 through the real
DistributedOptimizer (scripts/replay.py's worker)."""
import json
import tempfile
import time
from pathlib import Path

import pytest
import torch

import report
from hvcomm.sim import simulate
from hvcomm.sim.models import layer_profile, measured_profile
from hvcomm.sim.replay import ReplayModel
from hvcomm.torch.timeline import arrival_skew_s

ROOT = Path(__file__).resolve().parent.parent
TRACE = simulate.LayerTrace.load(simulate.TRACES / "resnet20-v100.json")


def test_replay_model_has_the_traced_shapes_and_takes_at_least_their_time():
    model = ReplayModel(TRACE)
    shapes = [tuple(p.shape) for p in model.parameters()]
    assert shapes == [s for layer in TRACE.layers for s in layer.shapes]
    model().backward()  # warm-up
    t0 = time.perf_counter()
    model().backward()
    elapsed = time.perf_counter() - t0
    assert elapsed >= 0.99 * (TRACE.compute_s - TRACE.update_s)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    # another rank replays other gradients
    other = ReplayModel(TRACE, rank=1)
    other().backward()
    assert not torch.equal(next(model.parameters()).grad, next(other.parameters()).grad)


def test_a_dilated_trace_takes_every_time_longer_and_keeps_its_shapes():
    slow = TRACE.dilated(3)
    for layer, dilated in zip(TRACE.layers, slow.layers, strict=True):
        assert (dilated.name, dilated.params, dilated.shapes) == (layer.name, layer.params,
                                                                  layer.shapes)
        assert (dilated.forward_s, dilated.backward_s) == pytest.approx(
            (3 * layer.forward_s, 3 * layer.backward_s), rel=1e-12)
    assert slow.update_s == pytest.approx(3 * TRACE.update_s, rel=1e-12)
    assert TRACE.dilated(1) == TRACE
    for bad in (0, 0.9, float("nan"), float("inf")):
        with pytest.raises(simulate.HvcommError, match="dilate must be"):
            TRACE.dilated(bad)


def test_a_dilated_replay_sleeps_dilate_times_as_long():
    factor = 5
    model = ReplayModel(TRACE.dilated(factor))
    model().backward()  # warm-up
    t0 = time.perf_counter()
    model().backward()
    elapsed = time.perf_counter() - t0
    # the undilated waits are TRACE.compute_s - update_s (the first test): five times that
    assert elapsed >= 0.99 * factor * (TRACE.compute_s - TRACE.update_s)


@pytest.mark.parametrize("alone, dilate", [(False, 1), (True, 1), (False, 3)])
def test_replay_at_two_ranks(alone, dilate):
    out = Path(tempfile.mkdtemp(prefix="hvcomm-replay-test-")) / "replay.json"
    methods = ["wfbp", "p3", "gtopk", "od-sgd", "cd-sgd"]
    res = report.run_worker(2, [str(ROOT / "scripts" / "replay.py"), "--worker", "--trace",
                               "resnet20-v100", "--methods", *methods, "--warmup", "3",
                               "--steps", "5", "--dilate", str(dilate)]
                           + (["--alone"] if alone else []), timeout=300, out=out)
    assert res["ranks"] == 2
    assert set(res["rows"]) == set(methods)
    floor = dilate * (TRACE.compute_s - TRACE.update_s)   # the waits alone
    assert all(t >= 0.99 * floor for t in res["rows"].values()), res
    # two ranks alone calibrate nothing (one-rank communicators); together they do
    assert (res["alpha_s"] > 0 and res["beta_s_per_byte"] > 0) != alone
    # together, how long they waited for each other at the timed steps' collectives
    assert set(res["skew_s"]) == (set() if alone else set(methods))
    assert all(s >= 0 for s in res["skew_s"].values())


def test_arrival_skew_sums_first_to_last_start_of_each_collective(tmp_path):
    def span(name, ts, tid=2):
        return {"name": name, "ph": "X", "ts": ts, "dur": 5, "pid": 0, "tid": tid}
    files = {0: [span("a", 1000), span("a", 100), span("b", 500), span("a", 0, tid=1)],
             1: [span("a", 130), span("b", 700), span("a", 990), span("c", 10),
                 span("a", 20)]}
    paths = []
    for rank, events in files.items():
        paths.append(tmp_path / f"t{rank}.json")
        paths[-1].write_text(json.dumps(events))
    # matched from the last: "a" 1000 and 990, then 100 and 130 (rank 1's first "a", at 20,
    # has no partner: it began before rank 0's timeline); "b": 500, 700; the main thread's
    # span and "c" (on one rank only) do not count
    assert arrival_skew_s(paths) == pytest.approx((30 + 10 + 200) / 1e6)


def test_measured_profile_has_the_models_layers_and_times():
    measured = measured_profile("resnet20", batch=4, steps=2)
    expected = layer_profile("resnet20")
    assert [(layer["name"], layer["shapes"], layer["params"]) for layer in measured["layers"]] == \
        [(layer["name"], layer["shapes"], layer["params"]) for layer in expected]
    assert all(layer["forward_s"] > 0 for layer in measured["layers"])
    assert all(layer["backward_s"] >= 0 for layer in measured["layers"])
    assert sum(layer["backward_s"] for layer in measured["layers"]) > 0 and measured["update_s"] > 0
    # as a trace, it replays
    trace = simulate.LayerTrace.from_dict({"model": "resnet20", "batch": 4, **measured})
    assert [tuple(p.shape) for p in ReplayModel(trace).parameters()] == \
        [tuple(s) for layer in expected for s in layer["shapes"]]


def test_replays_at_several_dilations_are_set_side_by_side(tmp_path, monkeypatch):
    import json
    import sys

    import replay

    def recorded(dilate, rows):
        return {"trace": "resnet20-v100", "network": "1gbit", "dilate": dilate, "rows": [
            {"P": p, "method": m, "measured ms": measured, "predicted / measured": ratio,
             "within 15%": abs(ratio - 1) <= 0.15} for p, m, measured, ratio in rows]}

    (tmp_path / "r.json").write_text(json.dumps(recorded(1, [(2, "wfbp", 100.0, 0.6)])))
    (tmp_path / "r_dilated10.json").write_text(json.dumps(recorded(10, [(2, "wfbp", 800.0,
                                                                         0.95)])))
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    monkeypatch.setattr(sys, "argv", ["replay.py", "--combine", "r"])
    replay.main()
    text = (tmp_path / "r_dilation.md").read_text()
    table = [line for line in text.splitlines() if line.startswith("|   2 |")]
    # P, method, then per dilation: measured / D and the ratio
    assert [cell.strip() for cell in table[0].strip("|").split("|")] == \
        ["2", "wfbp", "100", "0.6", "80", "0.95"]
    assert "Within 15%: D=1: 0 of 1, D=10: 1 of 1." in text


def test_the_simulators_error_counts_dilated_replays_apart(tmp_path, monkeypatch):
    import json

    import scale_sim

    def recorded(dilate, ratios):
        return {"trace": "resnet20-v100", "network": "1gbit", "dilate": dilate, "rows": [
            {"P": 2 ** (i + 1), "method": "wfbp", "predicted / measured": r,
             "within 15%": abs(r - 1) <= 0.15} for i, r in enumerate(ratios)]}

    (tmp_path / "replay_a.json").write_text(json.dumps(recorded(1, [0.9, 0.6])))
    (tmp_path / "replay_a_dilated10.json").write_text(json.dumps(recorded(10, [1.0, 0.96])))
    (tmp_path / "replay_a_dilated10.md").write_text("- date: 2026-11-26 10:00 UTC\n")
    # a later replay of P = 4 (by its date, though its name sorts first) supersedes that row;
    # one at a smaller dilation, later still, does not
    for name, dilate, ratio, date in (("0", 10, 0.5, "12:00"), ("b", 4, 0.7, "13:00")):
        later = recorded(dilate, [ratio])
        later["rows"][0]["P"] = 4
        (tmp_path / f"replay_{name}_dilated{dilate}.json").write_text(json.dumps(later))
        (tmp_path / f"replay_{name}_dilated{dilate}.md").write_text(
            f"- date: 2026-11-26 {date} UTC\n")
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    text = scale_sim.replay_error()
    assert ("undilated, 1 of 2 rows within 15%, median ratio 0.75, range 0.60-0.90; "
            "time-dilated, 2 of 4 rows within 15%, median ratio 0.83, range 0.50-1.00.") in text
    assert "resnet20-v100, 1gbit, dilated 10x" in text
    per_p = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")]
             for line in text.splitlines() if line.startswith("|   ") and line.count("|") == 6}
    assert per_p["2"] == ["2", "1", "1", "1", ""]
    assert per_p["4"] == ["4", "1", "0", "0.5", "wfbp 0.50 (resnet20-v100, 1gbit, D=10)"]
