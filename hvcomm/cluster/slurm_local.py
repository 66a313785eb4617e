"""A real Slurm on this machine: slurmctld, and one slurmd per emulated host.

Each host is a network namespace of an :class:`hvcomm.cluster.netem.EmulatedCluster` (its own
hostname, ``nodeN``; its traffic crosses the shaped link), so ``sbatch --nodes=2`` spans hosts
whose MPI traffic goes over the emulated network. The controller runs in this machine's own
namespace, reached over one more (unshaped) link into the hosts' bridge. Everything lives in
198.18.1.0/24 and under ``STATE`` (configuration, logs, spool); ``down`` removes all of it.

    python -m hvcomm.cluster.slurm_local up --nodes 4 --rate 1gbit
    python -m hvcomm.cluster.slurm_local status
    python -m hvcomm.cluster.slurm_local down

Needs root, Debian's ``slurm-wlm`` and ``munge`` (``scripts/slurm_local.sh`` installs them),
and what :mod:`hvcomm.cluster.netem` needs. The daemons run as root, with no cgroups (processes are
tracked through /proc), so it works inside a container or VM.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Optional

from collectives.errors import HvcommError

from . import netem

STATE = Path(os.environ.get("HVCOMM_SLURM_STATE", "/run/hvcomm-slurm"))
PREFIX, NET = "hvs-", "198.18.1"   # apart from the benchmarks' hvc- hosts in 198.18.0
CONTROLLER = f"{NET}.254"
CTL_LINK = PREFIX + "ctl"          # this namespace's end of the controller's link
SYSTEM_CONF = Path("/etc/slurm/slurm.conf")
CPUS_PER_NODE = 4                  # what each emulated node offers (they share the real cores)
PROGRAMS = ("slurmctld", "slurmd", "sbatch", "srun", "sinfo", "scontrol", "munged")

CONF = """\
# Written by hvcomm.cluster.slurm_local: {nodes} emulated nodes at {rate} per link.
ClusterName=hvcomm-local
SlurmctldHost={host}({controller})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation={state}/ctld
SlurmctldPidFile={state}/slurmctld.pid
SlurmctldLogFile={state}/slurmctld.log
SlurmdSpoolDir={state}/%n
SlurmdPidFile={state}/%n/slurmd.pid
SlurmdLogFile={state}/%n/slurmd.log
# no cgroups: processes tracked through /proc, tasks not bound
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
# the emulated nodes share this machine's cores: trust the CPUs declared here
SlurmdParameters=config_overrides
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
TmpFS={state}/node-tmp
ReturnToService=2
SlurmdTimeout=60
InactiveLimit=0
# SIGTERM to SIGKILL (default 30 s): at 5 s a busy machine's srun job was killed after its
# ranks had checkpointed but before the batch shell had logged it
KillWait=15
MinJobAge=600
# a requeued job waits cred_expire seconds before it may start again (default 120 s)
AuthInfo=cred_expire=10
# and then waits for a scheduler pass: look every few seconds (defaults 60 s and 30 s)
SchedulerParameters=sched_interval=5,bf_interval=5
NodeName=node[1-{nodes}] NodeAddr={net}.[1-{nodes}] CPUs={cpus} RealMemory=2000 State=UNKNOWN
PartitionName=emulated Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
# slurmd initialises a cgroup plugin even when nothing uses it; name the one that matches the
# machine's mounts, since autodetection fails on hybrid (v1 plus unified) hierarchies
CGROUP_CONF = """\
CgroupPlugin={plugin}
CgroupMountpoint=/sys/fs/cgroup
IgnoreSystemd=yes
"""


def missing() -> Optional[str]:
    """What this machine lacks to run the local Slurm, or None."""
    reason = netem.unsupported_reason()
    if reason:
        return reason
    lacking = [p for p in PROGRAMS if shutil.which(p) is None]
    if lacking:
        return (f"{', '.join(lacking)} not installed: run scripts/slurm_local.sh up (installs "
                "Debian's slurm-wlm, munge and libpmix-dev), or apt-get install them")
    return None


def _cluster(nodes: int, rate: str) -> netem.EmulatedCluster:
    return netem.EmulatedCluster(hosts=nodes, rate=rate, prefix=PREFIX, subnet=NET)


def _pid_alive(pidfile: Path) -> Optional[int]:
    try:
        pid = int(pidfile.read_text().split()[0])
        os.kill(pid, 0)
        return pid
    except (OSError, ValueError, IndexError):
        return None


def _cgroup_plugin() -> str:
    """cgroup/v2 where /sys/fs/cgroup is the unified hierarchy itself, else cgroup/v1."""
    fstype = netem.run_command("stat", "-f", "-c", "%T", "/sys/fs/cgroup",
                               check=False).stdout.strip()
    return "cgroup/v2" if fstype == "cgroup2fs" else "cgroup/v1"


def _stop(pid: int, grace_s: float = 10.0) -> None:
    """SIGTERM, and SIGKILL if the process is still there after ``grace_s``."""
    try:
        os.kill(pid, signal.SIGTERM)
        deadline = time.time() + grace_s
        while time.time() < deadline:
            os.kill(pid, 0)  # raises once it is gone
            time.sleep(0.1)
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _start_munge() -> None:
    """munged, as the munge user, unless one answers already."""
    if netem.run_command("munge", "-n", check=False).returncode == 0:
        return
    Path("/run/munge").mkdir(exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    netem.run_command("runuser", "-u", "munge", "--", "munged")
    STATE.joinpath("started-munged").touch()
    for _ in range(50):
        if netem.run_command("munge", "-n", check=False).returncode == 0:
            return
        time.sleep(0.1)
    raise HvcommError("munged did not start (see /var/log/munge/munged.log)")


def _wait_nodes_idle(nodes: int, timeout: float = 90.0) -> None:
    deadline = time.time() + timeout
    last = ""
    while time.time() < deadline:
        proc = netem.run_command("sinfo", "-h", "-N", "-o", "%N %t", check=False, env=slurm_env())
        last = proc.stdout.strip()
        states = [line.split()[1] for line in last.splitlines() if len(line.split()) == 2]
        if len(states) == nodes and all(s == "idle" for s in states):
            return
        time.sleep(1)
    raise HvcommError(f"the nodes did not become idle within {timeout:.0f} s; sinfo says:\n"
                      f"{last}\nlogs: {STATE}/slurmctld.log, {STATE}/node*/slurmd.log")


def slurm_env() -> dict:
    """The environment for Slurm's commands: this cluster's slurm.conf."""
    return {**os.environ, "SLURM_CONF": str(STATE / "slurm.conf")}


def up(nodes: int = 2, rate: str = "1gbit") -> None:
    """Start munge (if needed), the emulated hosts, slurmctld and one slurmd per host."""
    reason = missing()
    if reason:
        raise HvcommError(f"cannot start the local Slurm: {reason}")
    if not 1 <= nodes <= 16:
        raise HvcommError(f"nodes must be in [1, 16], got {nodes}")
    down(quiet=True)
    STATE.mkdir(parents=True, exist_ok=True)
    (STATE / "ctld").mkdir(exist_ok=True)
    (STATE / "node-tmp").mkdir(exist_ok=True)
    cluster = _cluster(nodes, rate)
    try:
        _start_munge()
        cluster.start()
        # this namespace's way into the bridge: the controller's address, no shaping
        netem.run_command("ip", "link", "add", CTL_LINK, "type", "veth", "peer", "pctl",
                          "netns", cluster.switch)
        netem.run_command("ip", "-n", cluster.switch, "link", "set", "pctl", "master", "br0", "up")
        netem.run_command("ip", "addr", "add", f"{CONTROLLER}/24", "dev", CTL_LINK)
        netem.run_command("ip", "link", "set", CTL_LINK, "up")
        conf = STATE / "slurm.conf"
        conf.write_text(CONF.format(nodes=nodes, rate=rate, controller=CONTROLLER, state=STATE,
                                    host=socket.gethostname().split(".")[0],
                                    net=NET, cpus=CPUS_PER_NODE))
        (STATE / "cgroup.conf").write_text(CGROUP_CONF.format(plugin=_cgroup_plugin()))
        (STATE / "cluster.json").write_text(json.dumps({"nodes": nodes, "rate": rate}))
        if not SYSTEM_CONF.exists() or SYSTEM_CONF.is_symlink():
            # plain sbatch/srun/sinfo find it there; a site's own file is never replaced
            SYSTEM_CONF.parent.mkdir(parents=True, exist_ok=True)
            SYSTEM_CONF.unlink(missing_ok=True)
            SYSTEM_CONF.symlink_to(conf)
        netem.run_command("slurmctld", "-f", str(conf))
        for i in range(nodes):
            name = f"node{i + 1}"
            tmp = STATE / name / "tmp"
            tmp.mkdir(parents=True)
            tmp.chmod(0o1777)
            # a host of its own: its hostname (slurmd takes its node name from it) and its
            # own TmpFS (Slurm's PMIx plugin keeps per-step files there under names that
            # are the same on every node); the rest of the file system is shared, as a
            # cluster's shared file system is
            netem.run_command(
                "ip", "netns", "exec", cluster.namespace(i), "unshare", "--uts", "--mount",
                "sh", "-c", f'mount --bind "{tmp}" "{STATE}/node-tmp" && hostname {name} && '
                f'exec slurmd -f "{conf}"')
        _wait_nodes_idle(nodes)
    except BaseException:
        down(quiet=True)
        raise
    print(f"local Slurm up: {nodes} nodes (node1..node{nodes}, {NET}.1-{nodes}), {rate} per "
          f"link; controller {CONTROLLER}; state in {STATE}")
    if not SYSTEM_CONF.is_symlink():
        print(f"{SYSTEM_CONF} is a site file, left alone: export SLURM_CONF={conf}")


def down(quiet: bool = False) -> None:
    """Stop every daemon and job of the local Slurm and remove its hosts. Safe to repeat."""
    pid = _pid_alive(STATE / "slurmctld.pid")
    if pid:
        _stop(pid)
    netem.cleanup_stale(PREFIX)   # slurmd, job steps, the hosts and the switch
    netem.run_command("ip", "link", "del", CTL_LINK, check=False)
    if SYSTEM_CONF.is_symlink() and str(os.readlink(SYSTEM_CONF)).startswith(str(STATE)):
        SYSTEM_CONF.unlink()
    if STATE.joinpath("started-munged").exists():
        netem.run_command("pkill", "-x", "munged", check=False)
    shutil.rmtree(STATE, ignore_errors=True)
    if not quiet:
        print("local Slurm down")


def crash_node(i: int) -> int:
    """A node crash: SIGKILL every process on emulated node ``i`` (1-based: slurmd, job
    steps, Open MPI's daemon, the ranks). Its slurmd stays down until the next ``up``.
    Returns how many processes were killed."""
    info = json.loads((STATE / "cluster.json").read_text())
    if not 1 <= i <= info["nodes"]:
        raise HvcommError(f"no node{i}: the local Slurm has node1..node{info['nodes']}")
    namespace = _cluster(info["nodes"], info["rate"]).namespace(i - 1)
    killed = netem.namespace_pids(namespace)
    netem.kill_namespace_processes(namespace)
    return len(killed)


def status() -> int:
    if not (STATE / "cluster.json").exists():
        print("local Slurm: down")
        return 1
    info = json.loads((STATE / "cluster.json").read_text())
    print(f"local Slurm: {info['nodes']} nodes at {info['rate']} per link; state in {STATE}")
    print(netem.run_command("sinfo", "-N", check=False, env=slurm_env()).stdout)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="A real Slurm on emulated nodes of this machine.")
    ap.add_argument("action", choices=["up", "down", "status"])
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--rate", default="1gbit", help="per-link rate, tc units (1gbit, 10gbit)")
    args = ap.parse_args(argv)
    try:
        if args.action == "up":
            up(args.nodes, args.rate)
        elif args.action == "down":
            down()
        else:
            return status()
    except HvcommError as e:
        print(f"slurm_local: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
