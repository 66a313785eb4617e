"""hvcomm.sim.simulate against cases computed by hand (flat, and on nodes of several GPUs), the
shipped traces, and the advisor."""
import subprocess
import sys

import pytest

from collectives.cost import AlphaBeta, hierarchical_allreduce_s
from collectives.errors import HvcommError
from hvcomm.sim import simulate as S

NET = S.Network("test", 10e-6, 1e9)          # alpha 10 us, beta 8 ns per byte
FAST = S.Network("fast", 1e-6, 80e9)         # inside a node: alpha 1 us, beta 0.1 ns per byte
FREE = S.ComputeCost(0.0, 0.0, 0.0)          # communication only
NODES = S.Cluster(2, 4, NET, FAST)           # N = 2 nodes of G = 4 GPUs


def trace(*layers, update_s=0.5e-3):
    """layers: (params, forward_s, backward_s) in forward order."""
    return S.LayerTrace("t", tuple(S.Layer(f"l{i}", p, f, b) for i, (p, f, b) in
                                   enumerate(layers)), batch=8, update_s=update_s)


ONE = trace((1000, 1e-3, 2e-3))
TWO = trace((1000, 0.5e-3, 2e-3), (3000, 0.5e-3, 1e-3))


def ms(method, t, p, compute=None, local_s=None, **settings):
    """Milliseconds at p hosts of one GPU on NET, or on a cluster given as p; ``settings``:
    the methods' (S.Settings' fields)."""
    cluster = p if isinstance(p, S.Cluster) else S.Cluster.flat(p, NET)
    return S.iteration(method, t, cluster, S.Settings(**settings), compute=compute,
                       local_s=local_s).iteration_s * 1e3


@pytest.mark.parametrize("method", S.METHODS)
def test_one_worker_is_computation_only(method):
    r = S.iteration(method, TWO, S.Cluster.flat(1, NET))
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
    assert S.iteration("od-sgd", ONE, S.Cluster.flat(2, slow)).iteration_s * 1e3 == \
        pytest.approx(32.02 + 0.5)


def test_delayed_family_with_slow_network():
    big = trace((1_000_000, 1e-3, 2e-3))     # 4 MB of gradients, 3 ms of computation
    # ring at P=4: 60 us + 1.5 * 4e6 B * 8 ns = 48.06 ms, longer than the computation
    assert ms("od-sgd", big, 4) == pytest.approx(48.06 + 0.5)
    assert ms("ssd-sgd", big, 4) == pytest.approx(48.06 + 0.5)   # resets are local
    # CD-SGD, k=5: four steps of 1-byte codes (60 us + 12 ms), then one at full precision
    assert ms("cd-sgd", big, 4) == pytest.approx((4 * 12.06 + 48.06) / 5 + 0.5)
    assert ms("cd-sgd", big, 4, delay_k=1) == pytest.approx(48.06 + 0.5)


def test_periodic_methods_pay_one_allreduce_per_period():
    big = trace((1_000_000, 1e-3, 2e-3))     # 4 MB of weights, 3.5 ms of computation and update
    # ring at P=4 of the whole model, 48.06 ms, once every period steps, not overlapped
    for method in ("local-sgd", "diloco"):
        assert ms(method, big, 4) == pytest.approx(3.5 + 48.06 / 16)
        assert ms(method, big, 4, period=4) == pytest.approx(3.5 + 48.06 / 4)


def test_streaming_diloco_hides_fragments_behind_inner_steps():
    from hvcomm.torch.methods.diloco import DiLoCo
    from hvcomm.torch.methods.periodic import periodic_s
    c = S.case(trace((1_000_000, 1e-3, 2e-3)), S.Cluster.flat(4, NET))
    # 4 fragments of 1 MB every 16 steps: a ring of 60 us + 1.5 * 1e6 B * 8 ns = 12.06 ms,
    # of which 2 steps of 3.5 ms hide 7 ms
    streaming = periodic_s(c, DiLoCo(period=16, fragments=4, overlap_steps=2))
    assert streaming * 1e3 == pytest.approx(3.5 + 4 * (12.06 - 7) / 16)
    assert periodic_s(c, DiLoCo(period=16)) * 1e3 == pytest.approx(3.5 + 48.06 / 16)


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


def test_coded_buckets_are_grouped_by_the_gradients_bytes():
    # the optimizer fills its buckets up to the threshold in the gradients' (float32) bytes,
    # whatever travels: at 10,000 B, TWO's l1 (12,000 B, ready at 2 ms) and l0 (4,000 B, at
    # 4 ms) are two buckets, though their codes would fit in one. At P=2, a bucket of M bytes
    # takes 20 us + M * 8 ns after it is ready, then the 0.5 ms update.
    # twobit: l1's 3,000 B end at 2.044 ms; l0's 1,000 B take 28 us from 4 ms
    assert ms("twobit", TWO, 2, compute=FREE, threshold_bytes=10_000) == pytest.approx(4.528)
    # fp16: 6,000 B end at 2.068 ms; 2,000 B take 36 us from 4 ms
    assert ms("fp16", TWO, 2, threshold_bytes=10_000) == pytest.approx(4.536)


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
    # P=2, slices of 1000: l1 (3000) is 3 slices, l0 one, each 20 us + 4000 B * 8 ns = 52 us,
    # beside which the readiness vector of 2 x 8 B goes (20.128 us, hidden); a readiness
    # exchange alone: 20.128 us. Steady state: l1's slices go during l0's backward; l0's is
    # ready at the end of backward, waits for an exchange and goes; the next forward's l0 waits
    # for it, then takes its share of the update (1000/4000 of 0.5 ms), and l1's share follows
    # its forward: the period is 4.5 ms + 20.128 us + 52 us.
    assert ms("p3", TWO, 2, slice_elems=1000) == pytest.approx(4.572128)
    # one slice per tensor: l1's single slice of 12000 B fits in l0's backward just the same
    assert ms("p3", TWO, 2, slice_elems=10_000) == pytest.approx(4.572128)


def test_bad_input():
    with pytest.raises(HvcommError, match="unknown method"):
        ms("allgatherx", ONE, 2)
    with pytest.raises(HvcommError, match="nodes must be a whole number >= 1"):
        S.Cluster.flat(0, NET)
    with pytest.raises(HvcommError, match="gpus_per_node must be"):
        S.Cluster(2, 0, NET, FAST)
    with pytest.raises(HvcommError, match="4 GPUs per node need the link between them"):
        S.Cluster(2, 4, NET)
    with pytest.raises(HvcommError, match="unknown network"):
        S.network("2gbit")
    with pytest.raises(HvcommError, match="unknown intra-node link"):
        S.intra_link("nvlink9")
    with pytest.raises(HvcommError, match="slice_elems"):
        ms("p3", ONE, 2, slice_elems=0)


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


# -- nodes of several GPUs --------------------------------------------------------------------
def test_hierarchical_allreduce_by_hand():
    ab_fast, ab_net = AlphaBeta.from_link(1e-6, 80e9), AlphaBeta.from_link(10e-6, 1e9)
    # N=2 nodes of G=4, 1e6 bytes. Reduce inside a node (a ring reduce-scatter, then a gather):
    # 2*3*1 us + 2*3/4 * 1e6 B * 0.1 ns = 6 + 150 us. Ring across the 2 nodes: 2*1*10 us +
    # 2*1/2 * 1e6 B * 8 ns = 20 + 8000 us. Broadcast inside (a scatter, then a ring
    # allgather): 6 + 150 us again. In all 8332 us.
    assert hierarchical_allreduce_s(2, 4, 1e6, ab_fast, ab_net) * 1e6 == pytest.approx(8332)
    assert NODES.allreduce_s(1e6) * 1e6 == pytest.approx(8332)
    # one GPU per node: the flat ring over 4, 2*3*10 us + 2*3/4 * 4000 B * 8 ns = 60 + 48 us
    assert hierarchical_allreduce_s(4, 1, 4000, ab_fast, ab_net) * 1e6 == pytest.approx(108)
    assert S.Cluster(4, 1, NET).allreduce_s(4000) * 1e6 == pytest.approx(108)
    # one node of 4: nothing crosses the network, one ring over the intra link: 6 + 150 us
    assert S.Cluster(1, 4, NET, FAST).allreduce_s(1e6) * 1e6 == pytest.approx(156)


@pytest.mark.parametrize("method", S.METHODS)
def test_one_gpu_per_node_is_the_flat_model(method):
    flat = S.iteration(method, TWO, S.Cluster.flat(4, NET), compute=FREE)
    for one_gpu in (S.Cluster(4, 1, NET), S.Cluster(4, 1, NET, FAST)):   # the link goes unused
        assert S.iteration(method, TWO, one_gpu, compute=FREE).iteration_s == flat.iteration_s


@pytest.mark.parametrize("method", ["wfbp", "single", "threshold", "merge_rule", "mgwfbp"])
def test_schedules_plan_with_the_hierarchical_allreduce(method):
    # 2 nodes of 4, 4000 B: reduce 2*3*1 + 1.5 * 4000 * 0.1e-3 = 6.6 us, ring across
    # 2*10 + 4000 * 8e-3 = 52 us, broadcast 6.6 us: 65.2 us after 3 ms, then 0.5 ms
    assert ms(method, ONE, NODES) == pytest.approx(3.5652)


def test_fp16_and_delayed_methods_use_the_hierarchical_allreduce():
    # fp16, 2000 B: 2 * (6 + 1.5 * 2000 * 0.1e-3) + 20 + 2000 * 8e-3 = 48.6 us
    assert ms("fp16", ONE, NODES) == pytest.approx(3.5 + 0.0486)
    # OD-SGD, 4 MB: 2 * (6 + 1.5 * 4e6 * 0.1e-3) + 20 + 4e6 * 8e-3 = 33232 us, not hidden
    big = trace((1_000_000, 1e-3, 2e-3))
    assert ms("od-sgd", big, NODES) == pytest.approx(33.232 + 0.5)


def test_gtopk_takes_its_first_rounds_inside_the_node():
    t = trace((4000, 1e-3, 2e-3))            # density 0.01: k = 40 pairs of 8 B
    # 2 rounds inside (G=4): 2*2*1 us + 2 * 40 * 17 B * 0.1 ns = 4.136 us; 1 round across
    # (N=2): 2*10 us + 40 * 17 B * 8 ns = 25.44 us
    assert ms("gtopk", t, NODES, density=0.01, compute=FREE) == pytest.approx(3.5 + 0.029576)
    # 3 merges of 2k = 80 pairs at 10 ns
    merges = S.ComputeCost(0.0, 1e-8, 0.0)
    assert ms("gtopk", t, NODES, density=0.01, compute=merges) == \
        pytest.approx(3.5 + 0.029576 + 3 * 80 * 1e-5)


def test_topk_reduces_inside_the_node_then_gathers_across():
    t = trace((4000, 1e-3, 2e-3))            # k = 40 pairs of 8 B; 16000 B dense
    # dense reduce inside: 6 + 1.5 * 16000 * 0.1e-3 = 8.4 us; AllGather across N=2:
    # 2*1*10 + 40 * 8 * 8e-3 = 22.56 us; broadcast of the 2*40 pairs (640 B, less than the
    # dense 16000 B): 6 + 1.5 * 640 * 0.1e-3 = 6.096 us
    assert ms("topk", t, NODES, density=0.01, compute=FREE) == pytest.approx(3.5 + 0.037056)
    # summing the N k = 80 gathered pairs at 10 ns
    sums = S.ComputeCost(0.0, 0.0, 1e-8)
    assert ms("topk", t, NODES, density=0.01, compute=sums) == pytest.approx(3.5 + 0.037856)
    # cheaper than the flat AllGather over 8 hosts: 2*3*10 + 7 * 40 * 8 * 8e-3 = 77.92 us
    assert ms("topk", t, 8, density=0.01, compute=FREE) == pytest.approx(3.5 + 0.07792)


def test_methods_that_cannot_be_modelled_say_why():
    many = S.Cluster(16, 8, NET, FAST)        # 128 workers: int8 sums of codes overflow
    with pytest.raises(HvcommError, match="at most 127"):
        S.iteration("twobit", ONE, many)
    ranked, left_out = S.compare(ONE, many)
    assert set(left_out) == {"twobit", "cd-sgd"} and "at most 127" in left_out["cd-sgd"]
    assert {r.method for r in ranked} == set(S.METHODS) - set(left_out)
    assert S.compare(ONE, S.Cluster(127, 1, NET))[1] == {}
