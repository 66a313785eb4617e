"""The stall inspector as a user meets it: the last rank sleeps 70 s before an allreduce that
the others already wait in. Run once with the defaults (a report every 60 s, no shutdown) and
once with HVCOMM_STALL_SHUTDOWN_S=20; writes results/stall_demo.md with what each printed,
its exit code and how long it took."""
from __future__ import annotations

import time
from pathlib import Path

from hvcomm.cluster import launch

import report

SCENARIO = Path(__file__).resolve().parent.parent / "tests" / "mpi" / "stall_or_fail.py"
SLEEP_S = 70


def run(ranks: int, env: dict) -> dict:
    t0 = time.monotonic()
    proc = launch.run(ranks, [str(SCENARIO), "stall", str(SLEEP_S)], timeout=300, env=env)
    took = time.monotonic() - t0
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines()
             if "hvcomm" in ln or "sum" in ln or "stall" in ln.lower()]
    return {"env": " ".join(f"{k}={v}" for k, v in env.items()) or "(defaults)",
            "exit": proc.returncode, "took s": f"{took:.1f}", "lines": lines}


def main() -> None:
    ranks = 2
    runs = [run(ranks, {}), run(ranks, {"HVCOMM_STALL_SHUTDOWN_S": "20"})]
    body = report.table([{k: v for k, v in r.items() if k != "lines"} for r in runs])
    for r in runs:
        body += f"\n\n## {r['env']}\n\n```\n" + "\n".join(r["lines"][:20]) + "\n```"
    path = report.write("stall_demo", "Stall inspector: one rank 70 s late to an allreduce",
                        report.setting(P=ranks, late_rank=ranks - 1, sleep_s=SLEEP_S,
                                       scenario="tests/mpi/stall_or_fail.py stall 70"), body)
    print(body)
    print(f"written to {path.relative_to(report.ROOT)}")


if __name__ == "__main__":
    main()
