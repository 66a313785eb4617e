"""Run the whole test suite several times while both cores are kept busy, and record each
run's outcome in results/loaded_tests.md: the proof that no test depends on thread timing.

The load is ``stress-ng --cpu <cores>`` (Debian's stress-ng) when installed, else one busy
Python process per core; it runs for the whole of every suite run and is always stopped.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time

import report


def start_load(cores: int) -> tuple[list, str]:
    if shutil.which("stress-ng"):
        return ([subprocess.Popen(["stress-ng", "--cpu", str(cores), "--quiet"])],
                f"stress-ng --cpu {cores}")
    busy = [sys.executable, "-c", "while True: pass"]
    return [subprocess.Popen(busy) for _ in range(cores)], f"{cores} busy Python loops"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    load, how = start_load(cores)
    rows = []
    try:
        for i in range(args.runs):
            t0 = time.monotonic()
            proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                   "--timeout=900", "tests"], cwd=report.ROOT,
                                  capture_output=True, text=True)
            took = time.monotonic() - t0
            summary = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
            counts = dict((k, int(v)) for v, k in re.findall(r"(\d+) (passed|failed|error|skipped)",
                                                            summary))
            rows.append({"run": i + 1, "exit": proc.returncode, "passed": counts.get("passed", 0),
                         "failed": counts.get("failed", 0) + counts.get("error", 0),
                         "skipped": counts.get("skipped", 0), "minutes": f"{took / 60:.1f}",
                         "pytest summary": summary.strip("= ")})
            print(rows[-1], flush=True)
            if proc.returncode:
                print(proc.stdout[-6000:], flush=True)
    finally:
        for p in load:
            p.kill()
            p.wait()
    green = sum(r["exit"] == 0 for r in rows)
    path = report.write("loaded_tests", "The test suite on a busy machine",
                        report.setting(load=f"{how} for the whole of every run ({cores} cores)",
                                       command="python -m pytest -q --timeout=900 tests",
                                       green=f"{green} of {len(rows)}"), report.table(rows))
    print(f"{green} of {len(rows)} green; written to {path.relative_to(report.ROOT)}")
    sys.exit(0 if green == len(rows) else 1)


if __name__ == "__main__":
    main()
