"""Serial references: simulate all P ranks of each collective in one process, plainly.

Written independently of the MPI code (dicts and contributor sets, no shared helpers), so
tests can compare the two exactly.
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import numpy as np

Pairs = Tuple[np.ndarray, np.ndarray]


def merge_select_ref(a: Dict[int, float], b: Dict[int, float], k: int) -> Dict[int, float]:
    merged = dict(a)
    for j, v in b.items():
        merged[j] = merged[j] + v if j in merged else v
    ranked = sorted(merged.items(), key=lambda jv: (-abs(jv[1]), jv[0]))[:k]
    return dict(ranked)


def gtopk_ref(inputs: Sequence[Pairs], k: int):
    """Returns (indices, values, reached masks per rank) of the binomial-tree gTop-k."""
    p = len(inputs)
    # node state: index -> (value, set of contributing ranks)
    nodes: List[Dict[int, Tuple[float, frozenset]]] = [
        {int(j): (v, frozenset([r])) for j, v in zip(*inputs[r])} for r in range(p)]
    step = 1
    while step < p:
        for i in range(0, p, 2 * step):
            if i + step < p:
                a, b = nodes[i], nodes[i + step]
                merged = dict(a)
                for j, (v, who) in b.items():
                    merged[j] = (merged[j][0] + v, merged[j][1] | who) if j in merged else (v, who)
                ranked = sorted(merged.items(), key=lambda it: (-abs(it[1][0]), it[0]))[:k]
                nodes[i] = dict(ranked)
        step *= 2
    final = sorted(nodes[0].items())
    idx = np.array([j for j, _ in final], np.int64)
    val = np.array([v for _, (v, _) in final])
    reached = [np.array([r in nodes[0].get(int(j), (0, frozenset()))[1]
                         for j in inputs[r][0]], bool)
               for r in range(p)]
    return idx, val, reached


def topk_allgather_ref(inputs: Sequence[Pairs]):
    total: Dict[int, float] = {}
    for idx, val in inputs:
        for j, v in zip(idx, val):
            total[int(j)] = total.get(int(j), 0) + v
    final = sorted(total.items())
    return np.array([j for j, _ in final], np.int64), np.array([v for _, v in final])
