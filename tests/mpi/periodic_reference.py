"""The serial reference of the periodic methods (local SGD, DiLoCo and its streaming form),
written from ALGORITHMS.md 7b and docs/, not from hvcomm's code, on references.py's data,
optimizer and compressors, in exact rational arithmetic. The factor P of references.py's
gradients keeps the average of the weights exact: each rank's weights are a part common to
every rank plus P times a part of its own, so their mean is a sum."""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Dict, List, Optional, Sequence, Tuple

from references import (SGD, Shapes, Snapshot, TopK, TwoBit, Vector, coefficients, curvature,
                        encode, gradient, initial_weights, numel, reduce)


@dataclass(frozen=True)
class PeriodicSpec:
    """Local SGD (outer_lr 1, no momentum, one fragment, no overlap, mix 1) or DiLoCo, as
    ALGORITHMS.md 7b and the periodic methods' docs state them."""
    period: int
    warmup_steps: int = 0
    outer_lr: Fraction = Fraction(1)
    outer_momentum: Fraction = Fraction(0)
    nesterov: bool = False
    fragments: int = 1
    overlap_steps: int = 0
    mix: Fraction = Fraction(1)


def split_fragments(sizes: Sequence[int], count: int) -> List[List[int]]:
    """Consecutive parameters; fragment f ends at the first parameter after which the
    fragments so far hold at least (f+1)/count of the elements, leaving one parameter for
    each fragment still to come."""
    total, cuts, held = sum(sizes), [], 0
    for i, n in enumerate(sizes):
        held += n
        f = len(cuts)
        if f < count - 1 and (held * count >= total * (f + 1)
                              or len(sizes) - 1 - i == count - 1 - f):
            cuts.append(i + 1)
    bounds = [0, *cuts, len(sizes)]
    return [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]


class PeriodicSimulation:
    """P ranks on the quadratic loss, each with its own ``sgd`` momentum buffers; the first
    warm-up steps average the gradients; after local step t (from 1) fragment f's average
    difference from the global weights is taken when t mod H = f*H // F, and applied
    ``overlap_steps`` later by the outer SGD (torch's momentum rule, Nesterov optional),
    after which each rank's fragment becomes (1 - mix) * local + mix * global. ``comp``: the
    differences travel through this compressor (top-k or 2-bit, one bucket per fragment),
    each rank keeping its residual."""

    def __init__(self, size: int, shapes: Shapes, sgd: SGD, spec: PeriodicSpec,
                 curved: bool = True, spread: int = 4, comp=None):
        assert comp is None or isinstance(comp, TwoBit) or (isinstance(comp, TopK)
                                                          and not comp.tree)
        self.size, self.shapes, self.names = size, shapes, list(shapes)
        self.sgd, self.spec, self.spread, self.comp = sgd, spec, spread, comp
        self.residuals: List[Dict[str, Vector]] = [{} for _ in range(size)]
        self.exchanges = [0] * spec.fragments  # of each fragment so far
        self.h = {n: curvature(n, numel(s), curved) for n, s in shapes.items()}
        start = initial_weights(shapes)
        self.local = [{n: list(v) for n, v in start.items()} for _ in range(size)]
        self.W = {n: list(v) for n, v in start.items()}
        self.buf: List[Dict[str, Optional[Vector]]] = [{n: None for n in shapes}
                                                       for _ in range(size)]
        self.outer_buf: Dict[str, Optional[Vector]] = {n: None for n in shapes}
        self.frags = [[self.names[i] for i in f] for f in split_fragments(
            [numel(shapes[n]) for n in self.names], spec.fragments)]
        self.waiting: List[Tuple[int, List[str], Dict[str, Vector]]] = []
        self.step_index = 0

    def step(self) -> Snapshot:
        s, P, d = self.step_index, self.size, self.spec
        grads = [{n: gradient(P, coefficients(r, s, n, numel(self.shapes[n]), self.spread),
                              self.h[n], self.local[r][n]) for n in self.names}
                 for r in range(P)]
        if s < d.warmup_steps:
            for n in self.names:
                avg = [sum(g[n][i] for g in grads) / P for i in range(len(grads[0][n]))]
                for r in range(P):
                    self.local[r][n], self.buf[r][n] = self.sgd.step(self.local[r][n], avg,
                                                                     self.buf[r][n])
                self.W[n] = list(self.local[0][n])
        else:
            for r in range(P):
                for n in self.names:
                    self.local[r][n], self.buf[r][n] = self.sgd.step(
                        self.local[r][n], grads[r][n], self.buf[r][n])
            t = s + 1 - d.warmup_steps
            self._apply(t)
            for f, names in enumerate(self.frags):
                if t % d.period == f * d.period // d.fragments:
                    self.waiting.append((t + d.overlap_steps, names, self._average(f)))
            self._apply(t)
        self.step_index += 1
        return self.snapshot()

    def _average(self, f: int) -> Dict[str, Vector]:
        """The average over the ranks of fragment f's difference W - w (as sent)."""
        names, P = self.frags[f], self.size
        deltas = [{n: [a - b for a, b in zip(self.W[n], self.local[r][n])] for n in names}
                  for r in range(P)]
        step, self.exchanges[f] = self.exchanges[f], self.exchanges[f] + 1
        if self.comp is None:
            return {n: [sum(d[n][i] for d in deltas) / P for i in range(len(self.W[n]))]
                    for n in names}
        group = list(reversed(names))  # one bucket, in the backward order
        sizes = [len(self.W[n]) for n in group]
        sent = []
        for r, d in enumerate(deltas):
            acc = [x for n in group for x in d[n]]
            if self.comp.error_feedback:
                kept = [x for n, m in zip(group, sizes)
                        for x in self.residuals[r].get(n, [Fraction(0)] * m)]
                acc = [a + e for a, e in zip(acc, kept)]
            payload, residual = encode(self.comp, acc, step, "|".join(group))
            at = 0
            for n, m in zip(group, sizes):
                self.residuals[r][n] = residual[at:at + m]
                at += m
            sent.append(payload)
        total, _ = reduce(self.comp, sent, sum(sizes), step)
        out, at = {}, 0
        for n, m in zip(group, sizes):
            out[n] = [x / P for x in total[at:at + m]]
            at += m
        return out

    def _apply(self, t: Optional[int]) -> None:
        d, rest = self.spec, []
        for due, names, delta in self.waiting:
            if t is not None and due > t:
                rest.append((due, names, delta))
                continue
            for n in names:
                step = delta[n]
                if d.outer_momentum:
                    b = self.outer_buf[n]
                    b = list(step) if b is None else [d.outer_momentum * x + y
                                                      for x, y in zip(b, step)]
                    self.outer_buf[n] = b
                    step = [x + d.outer_momentum * y for x, y in zip(step, b)] \
                        if d.nesterov else b
                self.W[n] = [w - d.outer_lr * u for w, u in zip(self.W[n], step)]
                for r in range(self.size):
                    self.local[r][n] = [(1 - d.mix) * x + d.mix * w
                                        for x, w in zip(self.local[r][n], self.W[n])]
        self.waiting = rest

    def finish_pending(self) -> Snapshot:
        """Exchanges under way are applied (none is started); every rank takes the global
        weights."""
        self._apply(None)
        for r in range(self.size):
            self.local[r] = {n: list(v) for n, v in self.W.items()}
        return self.snapshot()

    def snapshot(self) -> Snapshot:
        copy = lambda by_name: {n: list(v) for n, v in by_name.items()}  # noqa: E731
        return Snapshot([copy(x) for x in self.local], copy(self.W),
                        [copy(x) for x in self.residuals])
