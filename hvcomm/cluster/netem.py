"""An emulated cluster on one machine: H hosts in network namespaces, each behind its own
rate-limited veth link into a shared bridge, and an Open MPI launch across them.

Needs root, ``ip`` (iproute2) and ``tc``. Addresses come from 198.18.0.0/15, the range
reserved for network benchmarking; no traffic leaves the machine. Bandwidth is shaped with
``tbf`` in both directions of every link; added latency needs the ``netem`` qdisc, which
some kernels lack (then only latency 0 is accepted, and the veth's own ~10 us applies).

    with EmulatedCluster(hosts=4, rate="1gbit") as cluster:
        proc = cluster.mpirun(["script.py"], ranks_per_host=1, timeout=600)
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from collectives.errors import HvcommError

from . import launch

PREFIX = "hvc-"
SUBNET = "198.18.0"

# Open MPI's TCP transport (ob1 + btl tcp) sends the rest of a large message as ONE "put"
# fragment (btl_tcp_rdma_pipeline_frag_size defaults to 2 GiB), queued on the connection ahead
# of anything sent later. When two ranks exchange large messages over one connection (the ring
# at P = 2, pairwise exchanges at any P), the go-ahead a rank owes its peer for the peer's
# message can queue behind its own whole message, and the two directions of the full-duplex
# link run one after the other: a whole phase lost, as often as the race goes that way (more
# often beside computation). Without the put protocol (Open MPI 5's default flags less "put"),
# large messages go as a pipeline of 128 KiB sends, and both directions keep going; it was the
# best setting tried at 1 Gbit/s, P = 2 and 4, in the probe and in the replay, and faster than
# the shipped settings at 10 Gbit/s on hvcomm's engine (256 KiB put fragments were faster
# there, but slower at P = 4 on 1 Gbit/s). Evidence and every setting tried:
# results/contention_1gbit.md. The same setting is exported for Ethernet clusters in
# slurm/ethernet.sbatch.
TCP_MCA: Dict[str, str] = {"btl_tcp_flags": "send,inplace,need-ack,need-csum,hetero-rdma"}


def mca_text(settings: Dict[str, str]) -> str:
    """Open MPI settings as ``name=value`` pairs, to record beside a result ("" for none)."""
    return " ".join(f"{k}={v}" for k, v in sorted(settings.items()))

_AGENT = """#!/bin/sh
# hvcomm launch agent: Open MPI calls it as ssh would be ("agent HOST COMMAND...");
# it runs the command inside the network namespace of that emulated host instead, under a
# hostname and a TMPDIR of the host's own (Open MPI tells nodes apart by hostname and keeps
# its session directories under TMPDIR).
host="$1"; shift
TMPDIR="{tmp}/$host"; export TMPDIR
mkdir -p "$TMPDIR"
exec ip netns exec "{prefix}$host" unshare --uts sh -c "hostname $host && $*"
"""


def check_dilation(factor: float) -> float:
    """A time dilation factor: a finite number >= 1 (1: none)."""
    if not isinstance(factor, (int, float)) or not 1 <= factor < float("inf"):
        raise HvcommError(f"dilate must be a finite number >= 1 (1: no dilation), got {factor!r}")
    return float(factor)


class NetemUnavailable(HvcommError):
    """This machine cannot emulate a network (no root, no ip/tc, no namespaces)."""


def run_command(*cmd: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    """Run ``cmd`` capturing its output (``kw`` goes to subprocess.run); with ``check``, a
    non-zero exit raises HvcommError with what the command said."""
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if check and proc.returncode != 0:
        raise HvcommError(f"{' '.join(cmd)} failed: {(proc.stderr or proc.stdout).strip()}")
    return proc


def parse_rate_bit_s(rate: str) -> float:
    """'1gbit' -> 1e9, '100mbit' -> 1e8 (tc's units: bit, kbit, mbit, gbit)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmg]?)bit", rate.strip().lower())
    if not m:
        raise HvcommError(f"rate {rate!r}: use tc units such as 100mbit, 1gbit, 10gbit")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


def parse_latency_s(latency: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(us|ms|s)", latency.strip().lower())
    if not m:
        raise HvcommError(f"latency {latency!r}: use a number with us, ms or s (e.g. 50us)")
    return float(m.group(1)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[m.group(2)]


def _probe_name(what: str) -> str:
    """A namespace name for one check, this process's own (two test runs side by side probe at
    once) and outside every cluster's prefix (which a cluster's start sweeps away)."""
    return f"hvcomm-{what}-{os.getpid()}"


def unsupported_reason() -> Optional[str]:
    """Why this machine cannot run an emulated cluster, or None when it can."""
    if os.geteuid() != 0:
        return "network emulation needs root (network namespaces and tc)"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"network emulation needs '{tool}' (Debian package iproute2)"
    probe = _probe_name("probe")
    made = run_command("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create network namespaces here: {made.stderr.strip()}"
    run_command("ip", "netns", "del", probe, check=False)
    return None


def netem_available() -> bool:
    probe = _probe_name("qprobe")
    if run_command("ip", "netns", "add", probe, check=False).returncode != 0:
        return False
    try:
        return run_command("ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo",
                           "root", "netem", "delay", "1us", check=False).returncode == 0
    finally:
        run_command("ip", "netns", "del", probe, check=False)


def cleanup_stale(prefix: str = PREFIX) -> None:
    """Remove namespaces (and the processes in them) left by an earlier, killed run."""
    listing = run_command("ip", "netns", "list", check=False).stdout.split("\n")
    for line in listing:
        name = line.split(" ")[0]
        if name.startswith(prefix):
            kill_namespace_processes(name)
            run_command("ip", "netns", "del", name, check=False)


def namespace_pids(ns: str) -> List[int]:
    return [int(pid) for pid in run_command("ip", "netns", "pids", ns, check=False).stdout.split()]


def kill_namespace_processes(ns: str) -> None:
    for pid in namespace_pids(ns):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class EmulatedCluster:
    """Context manager: builds the hosts on entry, always tears them down on exit."""

    def __init__(self, hosts: int, rate: str = "1gbit", latency: str = "0us",
                 mpi_allreduce: str = "ring", *, tcp_mca: Optional[Dict[str, str]] = None,
                 prefix: str = PREFIX, subnet: str = SUBNET, dilate: float = 1):
        """``mpi_allreduce``: "ring" makes Open MPI use its ring allreduce (bandwidth-optimal:
        the strongest dense baseline on slow links; at 4 hosts and 1 Gbit/s its default choice
        measured 1.6-1.9x the ring model with the shipped TCP settings, 1.09x with
        :data:`TCP_MCA`: results/netem_verify.md), "default" leaves Open MPI's own decision.
        ``tcp_mca``: Open MPI settings for its TCP transport, default :data:`TCP_MCA`; ``{}``
        runs Open MPI's shipped ones. ``dilate``: time dilation, to run a cluster ``dilate``
        times slower than the one described: every link carries ``rate / dilate`` and its
        added latency is ``latency * dilate`` (computation stretched by the same factor, as
        :meth:`hvcomm.sim.simulate.LayerTrace.dilated` does, leaves the network's share of
        a step unchanged and shrinks the share of the hosts' shared CPU).
        ``prefix`` names the namespaces and ``subnet`` (a /24 in 198.18.0.0/15, as
        "198.18.N") numbers the hosts: two clusters with different ones can coexist."""
        if not re.fullmatch(r"198\.1[89]\.\d{1,3}", subnet) or int(subnet.split(".")[2]) > 255:
            raise HvcommError(f"subnet must be a /24 of 198.18.0.0/15 such as 198.18.1, "
                              f"got {subnet!r}")
        self.prefix, self._net = prefix, subnet
        if mpi_allreduce not in ("ring", "default"):
            raise HvcommError(f"mpi_allreduce must be 'ring' or 'default', got {mpi_allreduce!r}")
        self.mpi_allreduce = mpi_allreduce
        self.tcp_mca = dict(TCP_MCA if tcp_mca is None else tcp_mca)
        if hosts < 1 or hosts > 200:
            raise HvcommError(f"hosts must be in [1, 200], got {hosts}")
        self.hosts = hosts
        self.rate = rate
        self.rate_bit_s = parse_rate_bit_s(rate)
        self.latency = latency
        self.latency_s = parse_latency_s(latency)
        self.dilate = check_dilation(dilate)
        # what the links are shaped to
        self.shaped_rate_bit_s = self.rate_bit_s / self.dilate
        self.shaped_latency_s = self.latency_s * self.dilate
        self.addresses = [f"{subnet}.{i + 1}" for i in range(hosts)]
        self._agent_dir: Optional[Path] = None

    @property
    def subnet(self) -> str:
        return f"{self._net}.0/24"

    @property
    def switch(self) -> str:
        """The namespace of the bridge every host's link plugs into."""
        return self.prefix + "switch"

    def namespace(self, i: int) -> str:
        return self.prefix + self.addresses[i]

    def describe(self) -> str:
        lat = f", +{self.latency} latency" if self.latency_s else ""
        if self.dilate != 1:
            lat += (f", time dilated {self.dilate:g}x (shaped to "
                    f"{self.shaped_rate_bit_s / 1e6:g} Mbit/s"
                    + (f", +{self.shaped_latency_s * 1e6:g} us" if self.latency_s else "") + ")")
        tcp = mca_text(self.tcp_mca) or "as shipped"
        return (f"{self.hosts} emulated hosts, {self.rate} per link{lat} (tbf, netns, "
                f"{self.subnet}), Open MPI allreduce: {self.mpi_allreduce}, TCP: {tcp}")

    # -- set-up and tear-down --------------------------------------------------------------
    def __enter__(self) -> "EmulatedCluster":
        previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
        for s in previous:  # turn a kill into an exception, so __exit__ still tears down
            signal.signal(s, _raise_interrupt)
        self._previous_handlers = previous
        try:
            self.start()
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def start(self) -> None:
        """Build the hosts (after removing any left with this prefix). Without the
        with-block, the caller must :meth:`stop` them."""
        reason = unsupported_reason()
        if reason:
            raise NetemUnavailable(reason)
        if self.latency_s and not netem_available():
            raise NetemUnavailable("added latency needs the netem qdisc, which this kernel does "
                                   "not have; use latency 0us (bandwidth is still shaped)")
        cleanup_stale(self.prefix)
        try:
            self._build()
        except BaseException:
            self.stop()
            raise

    def _build(self) -> None:
        run_command("ip", "netns", "add", self.switch)
        run_command("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        run_command("ip", "-n", self.switch, "link", "set", "br0", "up")
        for i in range(self.hosts):
            ns, port = self.namespace(i), f"p{i}"
            run_command("ip", "netns", "add", ns)
            run_command("ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", port,
                        "netns", self.switch)
            run_command("ip", "-n", self.switch, "link", "set", port, "master", "br0", "up")
            run_command("ip", "-n", ns, "addr", "add", f"{self.addresses[i]}/24", "dev", "eth0")
            run_command("ip", "-n", ns, "link", "set", "eth0", "up")
            run_command("ip", "-n", ns, "link", "set", "lo", "up")
            self._shape(ns, "eth0")       # host -> switch
            self._shape(self.switch, port)  # switch -> host
        self._agent_dir = Path(tempfile.mkdtemp(prefix="hvcomm-agent-"))
        agent = self._agent_dir / "netns-agent"
        agent.write_text(_AGENT.format(prefix=self.prefix, tmp=self._agent_dir))
        agent.chmod(0o755)

    def _shape(self, ns: str, dev: str) -> None:
        rate = self.shaped_rate_bit_s
        # about 1 ms at the undilated rate: the same bytes at every dilation, so that dilation
        # changes no message's treatment, only the time
        burst = max(int(self.rate_bit_s / 8 / 1000), 32 * 1024)
        cmd = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root"]
        if self.latency_s:
            run_command(*cmd, "handle", "1:", "netem", "delay",
                        f"{self.shaped_latency_s * 1e6:.0f}us")
            cmd = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "parent", "1:"]
        run_command(*cmd, "tbf", "rate", f"{rate:.0f}bit", "burst", str(burst), "latency",
                    f"{50 * self.dilate:.0f}ms")

    def stop(self) -> None:
        """Kill every process on the hosts and remove them (the switch too)."""
        for i in range(self.hosts):
            kill_namespace_processes(self.namespace(i))
        for name in [self.namespace(i) for i in range(self.hosts)] + [self.switch]:
            run_command("ip", "netns", "del", name, check=False)
        if self._agent_dir:
            shutil.rmtree(self._agent_dir, ignore_errors=True)

    def __exit__(self, *exc) -> None:
        self.stop()
        for s, h in getattr(self, "_previous_handlers", {}).items():
            signal.signal(s, h)

    # -- running MPI jobs across the hosts --------------------------------------------------
    def mpirun_cmd(self, argv: Sequence[str], ranks_per_host: int = 1,
                   fault_tolerant: bool = False,
                   env: Optional[Dict[str, str]] = None) -> List[str]:
        """The command line; ``env``: the variables the job adds to this process's (those
        that must reach every host are passed on with ``-x``)."""
        if self._agent_dir is None:
            raise HvcommError("the emulated cluster is not set up; use it in a with-block")
        agent = str(self._agent_dir / "netns-agent")
        hosts = ",".join(f"{a}:{ranks_per_host}" for a in self.addresses)
        mca = ["--host", hosts,
               "--mca", "plm_rsh_agent", agent, "--prtemca", "plm_rsh_agent", agent,
               "--mca", "oob_tcp_if_include", self.subnet,
               "--prtemca", "oob_tcp_if_include", self.subnet,
               "--prtemca", "plm_rsh_no_tree_spawn", "1",  # tree spawn hangs beyond 2 hosts
               "--mca", "pml", "ob1", "--mca", "btl", "tcp,sm,self",
               "--mca", "btl_tcp_if_include", self.subnet,
               "--mca", "coll", "^han,xhc"]  # han and xhc assume one shared-memory node
        if self.mpi_allreduce == "ring":
            mca += ["--mca", "coll_tuned_use_dynamic_rules", "1",
                    "--mca", "coll_tuned_allreduce_algorithm", "4"]
        mca += [a for k, v in sorted(self.tcp_mca.items()) for a in ("--mca", k, v)]
        # Open MPI forwards only OMPI_* variables to the other hosts' daemons: add hvcomm's and
        # the thread limits (without OMP_NUM_THREADS=1 torch's OpenMP threads spin on every core)
        # and the kernel settings
        mca += [a for k in sorted(launch.mpi_env(env)) if k.startswith("HVCOMM_") or k in _FORWARD
                for a in ("-x", k)]
        cmd = launch.mpirun_cmd(self.hosts * ranks_per_host, argv, mca, fault_tolerant)
        return ["ip", "netns", "exec", self.namespace(0), "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', self.addresses[0], *cmd]

    def mpirun(self, argv: Sequence[str], ranks_per_host: int = 1, timeout: float = 600,
               env=None, capture: bool = True) -> subprocess.CompletedProcess:
        """Run ``python -m mpi4py ARGV`` with ``ranks_per_host`` ranks on every host."""
        return subprocess.run(self.mpirun_cmd(argv, ranks_per_host, env=env),
                              env=self.mpirun_env(env),
                              timeout=timeout, capture_output=capture, text=True)

    def mpirun_env(self, env: Optional[Dict[str, str]] = None) -> Dict[str, str]:
        """The environment for ``mpirun_cmd``: ``env`` on top of the MPI settings."""
        first = self._agent_dir / self.addresses[0]  # mpirun's own host: a TMPDIR of its own
        first.mkdir(exist_ok=True)
        return launch.mpi_env({**(env or {}), "TMPDIR": str(first)})

    def processes(self) -> List[int]:
        """The processes running on the emulated hosts now."""
        return [pid for i in range(self.hosts) for pid in namespace_pids(self.namespace(i))]


_FORWARD = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTHONUNBUFFERED", "PYTHONPATH",
            *launch.PORTABLE_KERNELS)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")
