"""Elastic training, measured: recovery from a lost rank, the cost of commit(), and what MPI's
fault tolerance (``mpirun --with-ft ulfm``) costs a job that loses nothing. Writes
results/elastic.md.

- Recovery: tests/mpi/elastic_train.py (the elastic tests' job: a small MLP, 4 samples per
  rank per step, a commit every 3 steps) with the last rank SIGKILLed after the backward pass
  of step 7, at P = 2, 3, 4 on shared memory, and on 2 emulated hosts x 2 ranks at 1 Gbit/s
  with both ranks of the second host killed at once; dense, gTop-k, OD-SGD and P3. Recovery
  = from the kill to the first step completed by the last survivor, from the job's own logs.
- commit(): the main job's digits model (scripts/workloads.py, 64-512-512-10, 8 samples per
  rank), dense DistributedOptimizer, TorchState(model, optimizer, two counters); the median
  of ``commit()`` against the median training step, at 2 ranks.
- Steady state: the same steps for a fixed count, with and without ``--with-ft ulfm``,
  alternating, three runs each; steps per second.
- A node crash: on 3 emulated hosts x 1 rank, the third host's rank kills its parent, Open
  MPI's daemon there, then itself; mpirun's exit status beside hvcomm's verdict. Under the
  local Slurm (root): 2 nodes x 1 rank, node2 crashed (every process on it killed), the job
  relaunched by slurm/ethernet.sbatch on node1; from the crash to the first step there.
- Growing back: can the survivors start a replacement (``MPI_Comm_spawn`` of the same
  program, merged into their communicator)? 3 ranks, the last SIGKILLed or not, on one node
  and on 3 emulated hosts; each probe gets 40 s.

    python scripts/bench_elastic.py            # everything (about 5 minutes)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import report
from hvcomm.cluster import launch, netem, outcome

HERE = Path(__file__).resolve().parent
JOB = HERE.parent / "tests" / "mpi" / "elastic_train.py"
SUITE = HERE.parent.parent / "shared" / "horovod_suite" / "run_elastic.sh"  # Horovod's
METHODS = ("none", "gtopk", "od-sgd", "p3")
FAIL_AT = 7


def recovery_s(directory: Path) -> float:
    """From the first failure logged to the first step completed at the new size by the last
    survivor to complete one."""
    failed, firsts = [], []
    for f in directory.glob("steps.rank*.jsonl"):
        rows = [json.loads(line) for line in f.read_text().splitlines()]
        failed += [r["time"] for r in rows if "failed" in r]
        sizes = [r["size"] for r in rows if "size" in r]
        if sizes and min(sizes) < max(sizes):
            firsts.append(min(r["time"] for r in rows if r.get("size") == min(sizes)))
    if not failed or not firsts:
        raise RuntimeError(f"no failure and recovery in the logs of {directory}")
    return max(firsts) - min(failed)


def run_job(cmd, env, timeout=180) -> str:
    start = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 or "OK size=" not in proc.stdout:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n"
                           + (proc.stdout + proc.stderr)[-3000:])
    return f"{time.monotonic() - start:.1f}"


def measure_recovery(net: str):
    rows = []
    for method in METHODS:
        for p in ((2, 3, 4) if net == "shm" else (4,)):
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp)
                args = [str(JOB), method, str(out), "--epochs", "1"]
                if net == "shm":
                    cmd = launch.mpirun_cmd(p, [*args, "--fail", f"{p - 1}:{FAIL_AT}"],
                                            fault_tolerant=True)
                    wall = run_job(cmd, launch.mpi_env())
                    lost = "rank 3 of 4" if p == 4 else f"rank {p - 1} of {p}"
                else:
                    with netem.EmulatedCluster(hosts=2, rate=net) as cluster:
                        cmd = cluster.mpirun_cmd([*args, "--fail", f"3:{FAIL_AT}:host"],
                                                 ranks_per_host=2, fault_tolerant=True)
                        wall = run_job(cmd, cluster.mpirun_env())
                    lost = "host 2 (ranks 2, 3) of 2 x 2"
                rows.append({"method": method, "P": p, "lost": lost,
                             "recovery (s)": round(recovery_s(out), 3), "job wall (s)": wall,
                             "exit": 0})
    return rows


# -- the workers (run under mpirun) ---------------------------------------------------------
def spawn_worker(out: Path, kill: bool) -> None:
    """The survivors (all ranks when ``kill`` is False) spawn one process of this program,
    merge with it and sum a vector over the merged communicator."""
    import numpy as np
    from mpi4py import MPI
    parent = MPI.Comm.Get_parent()
    if parent != MPI.COMM_NULL:  # the replacement
        merged = parent.Merge(high=True)
        merged.Allreduce(MPI.IN_PLACE, np.ones(4))
        return
    world = MPI.COMM_WORLD.Dup()
    world.Set_errhandler(MPI.ERRORS_RETURN)
    if kill and world.Get_rank() == world.Get_size() - 1:
        os.kill(os.getpid(), 9)
    try:
        world.Barrier()
    except MPI.Exception:
        world.Revoke()
        world = world.Shrink()
    t0 = time.perf_counter()
    child = world.Spawn(sys.executable, [__file__, "--worker", "spawn", "--out", str(out)],
                        maxprocs=1)
    merged = child.Merge(high=False)
    total = np.ones(4)
    merged.Allreduce(MPI.IN_PLACE, total)
    if merged.Get_rank() == 0:
        out.write_text(json.dumps({"size": merged.Get_size(), "sum": total[0],
                                   "spawn_s": time.perf_counter() - t0}))


def probe_spawn(kill: bool, net: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        argv = [__file__, "--worker", "spawn", "--out", str(out)] + (["--kill"] if kill else [])
        start = time.monotonic()
        try:
            if net == "shm":
                proc = subprocess.run(launch.mpirun_cmd(3, argv, fault_tolerant=True),
                                      env=launch.mpi_env(), capture_output=True, text=True,
                                      timeout=40)
            else:
                with netem.EmulatedCluster(hosts=3, rate=net) as cluster:
                    proc = subprocess.run(cluster.mpirun_cmd(argv, fault_tolerant=True),
                                          env=cluster.mpirun_env(), capture_output=True,
                                          text=True, timeout=40)
            ended = f"exit {proc.returncode}"
            if "Segmentation fault" in proc.stderr:
                ended += " (a segmentation fault in MPI_Finalize)" \
                    if "ompi_mpi_finalize" in proc.stderr else " (a segmentation fault)"
        except subprocess.TimeoutExpired:
            ended = "no end in 40 s (killed)"
        spawned = json.loads(out.read_text()) if out.exists() else None
    return {"where": "one node" if net == "shm" else f"3 emulated hosts, {net}",
            "rank lost first": "yes" if kill else "no",
            "replacement joined": (f"yes, size {spawned['size']}, in {spawned['spawn_s']:.2f} s"
                                   if spawned else "no"),
            "job": ended, "wall (s)": round(time.monotonic() - start, 1)}


def probe_daemon_loss(net: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        record = Path(tmp) / "outcome.json"
        with netem.EmulatedCluster(hosts=3, rate=net) as cluster:
            env = {outcome.ENV: str(record)}
            cmd = cluster.mpirun_cmd([str(JOB), "none", tmp, "--epochs", "1",
                                      "--fail", f"2:{FAIL_AT}:daemon"], fault_tolerant=True,
                                     env=env)
            start = time.monotonic()
            proc = subprocess.run(cmd, env=cluster.mpirun_env(env), capture_output=True,
                                  text=True, timeout=120)
        out = proc.stdout + proc.stderr
        status, why = outcome.verdict(record, proc.returncode)
        return {"where": f"3 emulated hosts x 1 rank, {net}", "lost": "host 3: rank 2 and "
                "its Open MPI daemon", "survivors finished": "yes" if "OK size=" in out else "no",
                "mpirun said": ("PRTE has lost communication with a remote daemon"
                                if "lost communication with a remote daemon" in out else "-"),
                "mpirun exit": proc.returncode, "hvcomm's verdict": f"exit {status}: {why}",
                "wall (s)": round(time.monotonic() - start, 1)}


def measure_node_relaunch(rate: str) -> dict:
    """The local Slurm (2 emulated nodes x 1 rank): slurm/ethernet.sbatch with ELASTIC=1 runs
    the elastic job (0.3 s steps, elastic state to disk at every commit); node2 crashes (every
    process on it killed) after 10 steps. From the crash to the first step on node1 alone."""
    from hvcomm.cluster import slurm_local
    reason = slurm_local.missing()
    if reason or os.geteuid() != 0:
        return {"node crash under Slurm": f"not measured: {reason or 'needs root'}"}
    slurm_local.up(2, rate)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            out, log = tmp / "run", tmp / "job.out"
            out.mkdir()
            env = {**slurm_local.slurm_env(), "ELASTIC": "1",
                   "HVCOMM_CHECKPOINT_DIR": str(tmp / "ckpt")}
            submitted = subprocess.run(
                ["sbatch", "--parsable", f"--output={log}", "--nodes=2", "--ntasks-per-node=1",
                 "--no-kill", "slurm/ethernet.sbatch", str(JOB), "none", str(out),
                 "--commit-every", "3", "--sleep", "0.3"], cwd=HERE.parent, env=env,
                capture_output=True, text=True, timeout=60, check=True)
            jobid = submitted.stdout.strip().split(";")[0]
            steps = out / "steps.rank1.jsonl"
            deadline = time.monotonic() + 240
            while not (steps.exists() and steps.read_text().count('"step"') >= 10):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the job did not reach step 10:\n{log.read_text()}")
                time.sleep(0.2)
            crashed = time.time()
            slurm_local.crash_node(2)
            while True:
                fields = dict(f.split("=", 1) for f in subprocess.run(
                    ["scontrol", "-o", "show", "job", jobid], env=env, capture_output=True,
                    text=True).stdout.split() if "=" in f)
                if fields.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                              "NODE_FAIL"):
                    break
                if time.time() > crashed + 400:
                    raise RuntimeError(f"job {jobid} did not end:\n{log.read_text()}")
                time.sleep(1)
            text = log.read_text()
            rows = [json.loads(line) for line in
                    (out / "steps.rank0.jsonl").read_text().splitlines()]
            alone = [r["time"] for r in rows if r.get("size") == 1]
            resumed = [line for line in text.splitlines() if "resumed from commit" in line]
            return {"where": f"local Slurm, 2 nodes x 1 rank, {rate}",
                    "lost": "node2 (slurmd, Open MPI's daemon, its rank)",
                    "relaunched on": "node1" if "relaunching on node1" in text else "-",
                    "resumed": resumed[0].split("hvcomm elastic: ")[-1] if resumed else "-",
                    "crash to first step (s)": round(min(alone) - crashed, 1) if alone else "-",
                    "job": f"{fields.get('JobState')}, exit {fields.get('ExitCode')}"}
    finally:
        slurm_local.down(quiet=True)


def worker(mode: str, steps: int, out: Path) -> None:
    import torch
    sys.path.insert(0, str(HERE))
    from workloads import WORKLOADS

    import hvcomm.torch as hvd
    hvd.init()
    model = WORKLOADS["digits"].model(0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                   named_parameters=model.named_parameters())
    g = torch.Generator().manual_seed(hvd.rank())
    x, y = torch.randn(8, 64, generator=g), torch.randint(0, 10, (8,), generator=g)
    state = hvd.elastic.TorchState(model, opt, epoch=0, batch=0)

    def step():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    for _ in range(20):
        step()
    if mode == "commit":
        step_s, commit_s = [], []
        for i in range(steps):
            t0 = time.perf_counter()
            step()
            t1 = time.perf_counter()
            state.batch = i
            state.commit()
            step_s.append(t1 - t0)
            commit_s.append(time.perf_counter() - t1)
        result = {"step_s": statistics.median(step_s), "commit_s": statistics.median(commit_s)}
    else:
        if mode == "watched":  # as after a survived failure (hvcomm.torch.ending)
            from hvcomm.torch import ending
            ending.watch_system_exit()
        hvd.allreduce(torch.zeros(1))  # start together
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        hvd.allreduce(torch.zeros(1))
        result = {"steps_per_s": steps / (time.perf_counter() - t0)}
    if hvd.rank() == 0:
        out.write_text(json.dumps({**result, "size": hvd.size(),
                                   "ft": os.environ.get("OMPI_MCA_mpi_ft_enable", "0")}))


def run_worker(mode: str, n: int, steps: int, ft: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        # the same launch but for the one flag (fault_tolerant= would also drop -m mpi4py)
        cmd = launch.mpirun_cmd(n, [__file__, "--worker", mode, "--steps", str(steps),
                                    "--out", str(out)], ["--with-ft", "ulfm"] if ft else [])
        proc = subprocess.run(cmd, env=launch.mpi_env(), capture_output=True, text=True,
                              timeout=600)
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"worker {mode} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
        return json.loads(out.read_text())


def horovod_elastic_suite() -> str:
    """Horovod 0.28.1's elastic unit tests at 1, 2 and 3 ranks, on hvcomm and on Horovod
    (the suite's own script; where it is not beside the project, a line that says so)."""
    if not SUITE.exists():
        return f"(Horovod's suite not found at {SUITE})"
    lines = []
    for impl in ("hvcomm", "horovod"):
        proc = subprocess.run(["bash", str(SUITE), "--impl", impl], cwd=HERE.parent,
                              capture_output=True, text=True, timeout=900,
                              env={**os.environ, "PY": sys.executable})
        lines += [f"    {line}" for line in proc.stdout.splitlines() if "np=" in line]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", choices=("commit", "throughput", "watched", "spawn"))
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--kill", action="store_true", help="spawn worker: lose the last rank first")
    ap.add_argument("--name", default="elastic", help="results/<name>.md")
    a = ap.parse_args()
    if a.worker == "spawn":
        return spawn_worker(a.out, a.kill)
    if a.worker:
        return worker(a.worker, a.steps, a.out)

    setting = report.setting(
        P="2, 3, 4 ranks on one node (2 cores: beyond 2, oversubscribed); 2 emulated hosts x 2",
        launch="mpirun --with-ft ulfm (Open MPI 5, ULFM)")
    shm = measure_recovery("shm")
    net, _ = report.resolve_net("1gbit")
    emulated = measure_recovery(net) if net != "shm" else []
    commit = run_worker("commit", 2, 100, ft=True)
    every = math.ceil(commit["commit_s"] / commit["step_s"] / 0.05)
    settings = {"mpirun": ("throughput", False), "mpirun --with-ft ulfm": ("throughput", True),
                "mpirun --with-ft ulfm, exit watch on": ("watched", True)}
    runs = {name: [] for name in settings}
    for _ in range(3):
        for name, (mode, ft) in settings.items():
            runs[name].append(run_worker(mode, 2, 300, ft)["steps_per_s"])
    median = {name: statistics.median(v) for name, v in runs.items()}
    throughput = [{"launch": name, "steps/s (3 runs)": ", ".join(f"{v:.1f}" for v in runs[name]),
                   "median": round(median[name], 1)} for name in settings]
    ratio = median["mpirun --with-ft ulfm"] / median["mpirun"]
    watched = median["mpirun --with-ft ulfm, exit watch on"] / median["mpirun --with-ft ulfm"]
    suite = horovod_elastic_suite()
    daemon = [probe_daemon_loss(net)] if net != "shm" else []
    relaunch = measure_node_relaunch(net if net != "shm" else "1gbit")
    spawn = [probe_spawn(kill, where) for where in ("shm", net) for kill in (False, True)
             if where == "shm" or net != "shm"]
    body = "\n".join([
        "## Recovery: from the kill to the first completed step after it",
        "Shared memory, the last rank SIGKILLed after its backward pass of step 7 (the others",
        "wait for its gradients); the job (192 samples, 4 per rank per step, commit every 3",
        "steps, one epoch) then finishes on the survivors and exits 0.", "",
        report.table(shm), "",
        f"Emulated cluster: 2 hosts (network namespaces) x 2 ranks, {net} per link (tc tbf both "
        "ways), MPI over TCP between the hosts: both ranks of the second host killed at once "
        "(its Open MPI daemon lives).", "",
        report.table(emulated) if emulated else "(no emulated cluster here)", "",
        "## commit() on the main job's model (64-512-512-10 MLP, dense, 2 ranks)", "",
        report.table([{"median step (ms)": round(commit["step_s"] * 1e3, 3),
                       "median commit() (ms)": round(commit["commit_s"] * 1e3, 3),
                       "commit / step": f"{commit['commit_s'] / commit['step_s']:.1%}"}]), "",
        "A commit copies the model and the optimizer's state (here 2 x 1.2 MB) into the buffers "
        "of the previous one, then one small broadcast (check_host_updates). Committing every "
        f"{every} steps keeps it under 5% of the training time, as Horovod advises committing "
        "less often than every batch.",
        "## Steady state: the same training with and without fault tolerance (2 ranks, "
        "300 steps)", "",
        report.table(throughput), "",
        f"With / without fault tolerance: {ratio:.3f} (medians of runs taken alternately). "
        "After a survived failure each survivor traces its main thread to see how the program "
        "ends (hvcomm.torch.ending.watch_system_exit; the row with the exit watch on): "
        f"{watched:.3f} of the steps per second without it, on this model whose 1 ms steps "
        "are mostly Python.", "",
        "## A node crash: its Open MPI daemon dies with its ranks", "",
        report.table(daemon) if daemon else "(no emulated cluster here)", "",
        "Open MPI 5's mpirun ends the job when it loses a daemon, and (as measured here) "
        "can exit 0 all the same; the job wrote no completion record, so hvcomm's verdict "
        "(hvcomm.cluster.outcome: what `python -m hvcomm.cluster.launch run` and "
        "slurm/common.sh report) is a failure. Inside one mpirun, hvcomm survives a node's "
        "ranks, not its daemon (the emulated-cluster recovery above, where the daemon lives).",
        "",
        "## A node crash under Slurm: one relaunch on the nodes left", "",
        report.table([relaunch]), "",
        "slurm/ethernet.sbatch with ELASTIC=1: when mpirun ends without a completion record, "
        "the batch script asks each node to run `true`, and launches again on those that "
        "answer; the elastic job resumes from the newest commit every rank saved to disk "
        "(HVCOMM_ELASTIC_SAVE_EVERY=1). The time includes Open MPI noticing the lost daemon, "
        "the probes (srun to a node whose slurmd is gone fails at once here), a new mpirun, "
        "Python and torch starting, and the resume.", "",
        "## Horovod 0.28.1's elastic unit tests (test_torch_elastic.py, import swapped)", "",
        suite, "",
        "At 2 and 3 ranks test_elastic_sampler fails under Horovod too: it assumes one "
        "process (ElasticSampler.record_batch counts batch_size times the number of ranks).",
        "",
        "## Growing back: a replacement spawned by the survivors (MPI_Comm_spawn)", "",
        report.table(spawn), "",
        "hvcomm.torch.elastic only shrinks: a replacement cannot be counted on where the job",
        "spans hosts, which is where a lost rank is a lost node.",
    ])
    path = report.write(a.name, "Elastic training on MPI's fault tolerance", setting, body)
    print(path.read_text())


if __name__ == "__main__":
    main()
