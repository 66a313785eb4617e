"""hvcomm.sim.simulate against cases computed by hand, the shipped traces, and the advisor."""
import subprocess
import sys

import pytest

from collectives.errors import HvcommError
from hvcomm.sim import simulate as S

NET = S.Network("test", 10e-6, 1e9)          # alpha 10 us, beta 8 ns per byte
FREE = S.ComputeCost(0.0, 0.0, 0.0)          # communication only


def trace(*layers, update_s=0.5e-3):
    """layers: (params, forward_s, backward_s) in forward order."""
    return S.LayerTrace("t", tuple(S.Layer(f"l{i}", p, f, b) for i, (p, f, b) in
                                   enumerate(layers)), batch=8, update_s=update_s)


ONE = trace((1000, 1e-3, 2e-3))
TWO = trace((1000, 0.5e-3, 2e-3), (3000, 0.5e-3, 1e-3))


def ms(method, t, p, **kw):
    return S.iteration(method, t, p, NET, **kw).iteration_s * 1e3


@pytest.mark.parametrize("method", S.METHODS)
def test_one_worker_is_computation_only(method):
    r = S.iteration(method, TWO, 1, NET)
    assert r.iteration_s == pytest.approx(4.5e-3) and r.efficiency == pytest.approx(1.0)


@pytest.mark.parametrize("method", ["wfbp", "single", "threshold", "merge_rule", "mgwfbp"])
def test_one_bucket(method):
    # ring at P=4: 2*3*10 us + 2*3/4 * 4000 B * 8 ns = 60 + 48 us, after 3 ms, then 0.5 ms
    assert ms(method, ONE, 4) == pytest.approx(3.608)


def test_wfbp_overlaps_and_single_waits():
    # P=2, T(n) = 20 us + n * 8 ns. Backward order: l1 (12000 B) ready at 1+1 = 2 ms, ends
    # 2.116 ms; l0 (4000 B) ready at 4 ms, ends 4.052 ms; + 0.5 ms update
    assert ms("wfbp", TWO, 2) == pytest.approx(4.552)
    # one message of 16000 B at 4 ms: 20 + 128 us
    assert ms("single", TWO, 2) == pytest.approx(4.648)
    assert ms("mgwfbp", TWO, 2) == pytest.approx(4.552)   # the best grouping is WFBP here


@pytest.mark.parametrize("p, rounds", [(4, 2), (6, 3)])
def test_gtopk_rounds_power_and_non_power_of_two(p, rounds):
    t = trace((4000, 1e-3, 2e-3))            # d = 4000, density 0.01: k = 40, 8-byte pairs
    comm_us = 2 * rounds * 10 + rounds * 40 * 17 * 8e-3   # pairs up and down, + mask bytes
    assert ms("gtopk", t, p, density=0.01, compute=FREE) == pytest.approx(3.5 + comm_us / 1e3)
    cost = S.ComputeCost(1e-9, 1e-8, 0.0)    # selection of 4000, merges of 2k pairs per round
    extra_us = 4000 * 1e-3 + rounds * 80 * 1e-2
    assert ms("gtopk", t, p, density=0.01, compute=cost) == \
        pytest.approx(3.5 + (comm_us + extra_us) / 1e3)


def test_topk_allgather_grows_with_p():
    t = trace((4000, 1e-3, 2e-3))
    # P=6: counts and pairs, 2*ceil(log2 6) = 6 latencies; 5 * 40 pairs of 8 B received
    assert ms("topk", t, 6, density=0.01, compute=FREE) == pytest.approx(3.5 + (60 + 12.8) / 1e3)


def test_od_sgd_hides_communication_up_to_the_computation():
    # ring at P=2 of 4000 B: 52 us, hidden by 3 ms of forward and backward
    assert ms("od-sgd", ONE, 2) == pytest.approx(3.5)
    slow = S.Network("slow", 10e-6, 1e6)     # 1 Mbit/s: 20 us + 32 ms, not hidden
    assert S.iteration("od-sgd", ONE, 2, slow).iteration_s * 1e3 == pytest.approx(32.02 + 0.5)


def test_delayed_family_with_slow_network():
    big = trace((1_000_000, 1e-3, 2e-3))     # 4 MB of gradients, 3 ms of computation
    # ring at P=4: 60 us + 1.5 * 4e6 B * 8 ns = 48.06 ms, longer than the computation
    assert ms("od-sgd", big, 4) == pytest.approx(48.06 + 0.5)
    assert ms("ssd-sgd", big, 4) == pytest.approx(48.06 + 0.5)   # resets are local
    # CD-SGD, k=5: four steps of 1-byte codes (60 us + 12 ms), then one at full precision
    assert ms("cd-sgd", big, 4) == pytest.approx((4 * 12.06 + 48.06) / 5 + 0.5)
    assert ms("cd-sgd", big, 4, delay_k=1) == pytest.approx(48.06 + 0.5)


def test_fp16_twobit_and_randomk_send_fewer_bytes():
    # ring at P=4 of one bucket: 2*3*10 us = 60 us + 2*3/4 * bytes * 8 ns, after 3 ms, + 0.5 ms
    assert ms("fp16", ONE, 4) == pytest.approx(3.5 + (60 + 1.5 * 2000 * 8e-3) / 1e3)
    assert ms("twobit", ONE, 4, compute=FREE) == pytest.approx(3.5 + (60 + 1.5 * 1000 * 8e-3) / 1e3)
    # quantisation: one pass over the 1000 gradients at 1 ns each, on the critical path
    assert ms("twobit", ONE, 4, compute=S.ComputeCost(1e-9, 0.0, 0.0)) == \
        pytest.approx(3.5 + (60 + 12 + 1) / 1e3)
    # P=2, density 0.1: l1's 300 values (1200 B) ready at 2 ms end at 2.0296 ms; l0's 100
    # values (400 B) ready at 4 ms take 20 + 3.2 us; + 0.5 ms update
    assert ms("randomk", TWO, 2, density=0.1, compute=FREE) == pytest.approx(4.5232)


def test_powersgd_sends_the_factors_in_two_allreduces():
    t = S.LayerTrace("t", (S.Layer("l0", 5100, 1e-3, 2e-3, ((100, 50), (100,))),), batch=8,
                     update_s=0.5e-3)
    # rank 4: P 100x4 and the vector's 100 in the first allreduce (2000 B: 20 + 16 us at P=2),
    # Q 50x4 in the second (800 B: 20 + 6.4 us)
    assert ms("powersgd", t, 2, compute=FREE) == pytest.approx(3.5 + 0.0624)
    # the two products charged as 4 passes over the 5100 gradients at 1 ns each
    assert ms("powersgd", t, 2, compute=S.ComputeCost(1e-9, 0.0, 0.0)) == \
        pytest.approx(3.5 + 0.0624 + 0.0204)


def test_p3_waits_per_layer_in_the_next_forward():
    # P=2, slices of 1000: l1 (3000) is 3 slices, l0 one; each slice carries a readiness
    # vector of 2 x 4 B: 20 us + 4008 B * 8 ns = 52.064 us; a readiness exchange of 2 x 8 B:
    # 20.128 us. Steady state: l1's slices go during l0's backward; l0's is ready at the end
    # of backward, waits for an exchange and goes; the next forward's l0 waits for it, then
    # takes its share of the update (1000/4000 of 0.5 ms), and l1's share follows its forward:
    # the period is 4.5 ms + 20.128 us + 52.064 us.
    assert ms("p3", TWO, 2, slice_elems=1000) == pytest.approx(4.572192)
    # one slice per tensor: l1's single slice of 12008 B fits in l0's backward just the same
    assert ms("p3", TWO, 2, slice_elems=10_000) == pytest.approx(4.572192)


def test_bad_input():
    with pytest.raises(HvcommError, match="unknown method"):
        S.iteration("allgatherx", ONE, 2, NET)
    with pytest.raises(HvcommError, match="workers"):
        S.iteration("gtopk", ONE, 0, NET)
    with pytest.raises(HvcommError, match="unknown network"):
        S.network("2gbit")
    with pytest.raises(HvcommError, match="slice_elems"):
        S.iteration("p3", ONE, 2, NET, slice_elems=0)


def test_shipped_traces_load():
    for path in sorted(S.TRACES.glob("*.json")):
        t = S.LayerTrace.load(path)
        assert t.params > 0 and t.compute_s > 0 and t.source, path
    assert S.LayerTrace.load(S.TRACES / "resnet50-v100.json").params == 25_557_032


def test_advisor_ranks_best_first():
    proc = subprocess.run([sys.executable, "-m", "hvcomm.sim.advise", "--model", "vgg16", "--gpu",
                           "v100", "--workers", "32", "--net", "1gbit"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines()
            if line.startswith("| ") and "method" not in line]
    times = [float(r[1]) for r in rows]
    assert len(rows) == len(S.METHODS) and times == sorted(times), proc.stdout
    bad = subprocess.run([sys.executable, "-m", "hvcomm.sim.advise", "--model", "vgg16", "--gpu",
                          "h900", "--workers", "4"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "available" in bad.stderr, bad.stderr


def test_measured_local_cost_replaces_the_modelled_selection():
    t = trace((4000, 1e-3, 2e-3))
    lots = S.ComputeCost(1.0, 0.0, 0.0)      # a modelled selection of 4000 s: must not count
    got = ms("gtopk", t, 4, density=0.01, compute=lots, local_s=2e-3)
    assert got == pytest.approx(3.5 + 2.0 + (2 * 2 * 10 + 2 * 40 * 17 * 8e-3) / 1e3)
    assert ms("wfbp", ONE, 4, local_s=1e-3) == pytest.approx(3.608 + 1.0)
    assert ms("od-sgd", ONE, 1, local_s=1e-3) == pytest.approx(4.5)
