"""The emulated cluster: hosts in distinct namespaces, shaped links, and a clean tear-down."""
import json
import subprocess

import pytest

import report
from hvcomm.cluster import netem
from mpi_launch import HERE

REASON = netem.unsupported_reason()
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"no network emulation here: {REASON}")


def namespaces():
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split(" ")[0] for line in out.splitlines() if line.startswith(netem.PREFIX)}


@needs_netns
@pytest.mark.parametrize("rate, dilate", [("20mbit", 1), ("80mbit", 4)])
def test_two_hosts_distinct_namespaces_and_shaped_link(rate, dilate):
    """A link carries its rate, divided by the time dilation: 80 Mbit/s dilated 4x is 20."""
    rate_bit_s, nbytes = 20e6, 2_000_000   # unshaped veth moves this in well under 50 ms
    with netem.EmulatedCluster(hosts=2, rate=rate, dilate=dilate) as cluster:
        qdisc = subprocess.run(["ip", "netns", "exec", cluster.namespace(1), "tc", "qdisc", "show",
                                "dev", "eth0"], capture_output=True, text=True).stdout
        assert "tbf" in qdisc and "20Mbit" in qdisc, qdisc
        proc = cluster.mpirun([str(HERE / "mpi" / "check_netem.py"), str(nbytes)], timeout=120,
                              env={"HVCOMM_TEST_EXPECT_SIZE": "2"})
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "OK size=2" in proc.stdout
        report = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
        assert report["namespaces"] == [cluster.namespace(0), cluster.namespace(1)]
        for direction, seconds in zip(("0 -> 1", "1 -> 0"), report["seconds"]):
            bandwidth = nbytes * 8 / seconds
            # shaped: not faster than the rate (tbf's burst of 32 KiB is under 2% of the
            # message), and not far slower
            assert 0.4 * rate_bit_s < bandwidth < 1.5 * rate_bit_s, \
                f"{direction}: {bandwidth / 1e6:.1f} Mbit/s on a 20 Mbit/s link"
    assert namespaces() == set()


@needs_netns
def test_teardown_when_the_job_fails():
    with pytest.raises(RuntimeError, match="boom"):
        with netem.EmulatedCluster(hosts=2, rate="1gbit"):
            assert len(namespaces()) == 3  # two hosts and the switch
            raise RuntimeError("boom")
    assert namespaces() == set()


def test_clear_error_without_root(monkeypatch):
    monkeypatch.setattr(netem.os, "geteuid", lambda: 1000)
    assert "root" in netem.unsupported_reason()
    with pytest.raises(netem.NetemUnavailable, match="needs root"):
        with netem.EmulatedCluster(hosts=2):
            pass
    net, label = report.resolve_net("1gbit")
    assert net == "shm" and "emulation unavailable" in label


def test_bad_settings_are_rejected():
    for kw in ({"hosts": 0}, {"hosts": 2, "rate": "fast"}, {"hosts": 2, "latency": "5 parsecs"},
               {"hosts": 2, "dilate": 0.5}, {"hosts": 2, "dilate": float("inf")},
               {"hosts": 2, "dilate": "10"}):
        with pytest.raises(netem.HvcommError):
            netem.EmulatedCluster(**kw)
    assert netem.parse_rate_bit_s("100mbit") == 1e8
    assert netem.parse_latency_s("50us") == pytest.approx(50e-6)


def test_shared_memory_cannot_be_dilated(tmp_path):
    with pytest.raises(ValueError, match="shared memory cannot be dilated"):
        report.run_worker(2, ["unused.py"], timeout=10, out=tmp_path / "out.json", dilate=4)
