"""Top-k selection time: exact torch.topk vs exact NumPy partition vs hvcomm's sampled
selector, with recall against exact top-k. Writes results/selection.md."""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

import report
from hvcomm.torch.methods.selection import SampledTopk, exact_topk, recall


def best_of(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, nargs="+", default=[1_000_000, 25_000_000])
    ap.add_argument("--density", type=float, nargs="+", default=[0.001, 0.01])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for d in args.d:
        # a gradient-like vector: mostly small, heavy-tailed
        x = (np.random.default_rng(d).standard_t(3, d) * 1e-3).astype(np.float32)
        xt = torch.from_numpy(x)
        for density in args.density:
            k = max(int(d * density), 1)
            sel = SampledTopk(seed=0)
            t_torch = best_of(lambda: torch.topk(xt.abs(), k, sorted=False), args.repeats)
            t_np = best_of(lambda: exact_topk(x, k), args.repeats)
            t_s = best_of(lambda: sel(x, k), args.repeats)
            rows.append({"d": f"{d:,}", "density": density, "k": f"{k:,}",
                         "torch.topk s": f"{t_torch:.4f}", "numpy partition s": f"{t_np:.4f}",
                         "sampled s": f"{t_s:.4f}",
                         "speed-up vs torch.topk": f"{t_torch / t_s:.1f}",
                         "recall": f"{recall(sel(x, k), x, k):.4f}",
                         "candidates/k": f"{sel.last_candidates / k:.2f}",
                         "fallbacks": sel.fallbacks})
            print(rows[-1], flush=True)
    text = report.table(rows)
    print(text)
    report.write("selection", "Top-k selection: exact vs sampled threshold", report.setting(
        network="none (local computation on one core)",
        threads="1 (torch.set_num_threads(1))", data="Student-t(3) * 1e-3, float32",
        timing=f"best of {args.repeats} after one warm-up",
        selector="SampledTopk: 20,000-element sample, threshold for 1.25 k candidates, exact "
                 "top-k among them (recall 1.0 whenever >= k pass), else lower it, else exact"),
        text)


if __name__ == "__main__":
    main()
