"""Serial references for the delayed methods (OD-SGD, SSD-SGD with GLU, CD-SGD, DC-ASGD's local
step) and the compressors
(top-k, gTop-k, random-k, 2-bit, each with its error feedback), written from ALGORITHMS.md
and docs/, not from hvcomm's code: nothing of hvcomm is imported. All P ranks are
simulated in one process by plain loops, in exact rational arithmetic (fractions.Fraction),
so a test compares hvcomm's float64 results with ``==``; ``exact_float`` says where a
reference value would not be representable in float64 (then the data, not hvcomm, is at
fault).

The data: integer-valued gradients g = P * (c + h*w) of the loss P * sum(c*w + h*w*w/2), with
c drawn per (rank, step, parameter) and the curvature h in {0, 1} per element (h = 0 makes the
gradient independent of the weights). The factor P keeps the average (a sum times 1/P)
exact; learning rates, momentum, weight decay and thresholds are powers of two.
periodic_reference.py builds the periodic methods' reference from these parts.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from fractions import Fraction
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

Vector = List[Fraction]
Shapes = Dict[str, Tuple[int, ...]]


# -- the data ----------------------------------------------------------------------------------
def numel(shape: Tuple[int, ...]) -> int:
    return int(np.prod(shape, dtype=np.int64))


def coefficients(rank: int, step: int, name: str, n: int, spread: int = 4) -> List[int]:
    """The linear coefficients c of one parameter's loss on one rank at one step: integers
    in [-spread, spread] (many equal magnitudes: the tie rules matter)."""
    rng = np.random.default_rng([rank, step, zlib.crc32(name.encode())])
    return [int(v) for v in rng.integers(-spread, spread + 1, n)]


def curvature(name: str, n: int, on: bool) -> List[int]:
    """h in {0, 1} per element (the same on every rank), or all 0."""
    if not on:
        return [0] * n
    rng = np.random.default_rng([7, zlib.crc32(name.encode())])
    return [int(v) for v in rng.integers(0, 2, n)]


def initial_weights(shapes: Shapes) -> Dict[str, Vector]:
    """Small integers, the same on every rank."""
    rng = np.random.default_rng(11)
    return {n: [Fraction(int(v)) for v in rng.integers(-3, 4, numel(s))]
            for n, s in shapes.items()}


def gradient(size: int, c: Sequence[int], h: Sequence[int], w: Vector) -> Vector:
    return [size * (ci + hi * wi) for ci, hi, wi in zip(c, h, w)]


def exact_float(x: Fraction) -> bool:
    """x is a float64 exactly (it is its own rounding)."""
    try:
        return Fraction(float(x)) == x
    except OverflowError:  # beyond float64's range, or an int/int too large to divide
        return False


# -- the wrapped optimizer: torch.optim.SGD's documented rule ----------------------------------
@dataclass(frozen=True)
class SGD:
    lr: Fraction
    momentum: Fraction = Fraction(0)
    weight_decay: Fraction = Fraction(0)

    def step(self, p: Vector, g: Vector, buf: Optional[Vector]) -> Tuple[Vector, Optional[Vector]]:
        """d = g + wd*p; with momentum buf = d at first, then momentum*buf + d, and d = buf;
        p - lr*d. Returns the new p and buf."""
        d = [gi + self.weight_decay * pi for gi, pi in zip(g, p)]
        if self.momentum:
            buf = d if buf is None else [self.momentum * b + di for b, di in zip(buf, d)]
            d = buf
        return [pi - self.lr * di for pi, di in zip(p, d)], buf


# -- the compressors ---------------------------------------------------------------------------
DGC_STAGES = (0.25, 0.0625, 0.015625, 0.004)


@dataclass(frozen=True)
class TopK:
    """The k largest |acc| (ties: the lower index), k = max(floor(density*n), 1) at most n,
    DGC's warm-up (each stage a quarter of ``warmup_steps``, never below ``density``);
    ``tree``: summed by the gTop-k tree instead of gathered."""
    density: float
    warmup_steps: int = 0
    scope: str = "layer"
    tree: bool = False
    error_feedback = True

    def k(self, n: int, step: int) -> int:
        density = self.density
        if step < self.warmup_steps:
            density = max(DGC_STAGES[step * len(DGC_STAGES) // self.warmup_steps], density)
        return min(n, max(1, int(density * n)))


@dataclass(frozen=True)
class RandomK:
    """k = max(floor(density*n), 1) indices drawn by NumPy's default_rng seeded
    [seed, step, crc32(bucket key)], without replacement, the same on every rank; unbiased:
    the values times n/k and no residual; error_feedback: unscaled, the rest kept."""
    density: float
    seed: int = 0
    variant: str = "unbiased"
    scope = "layer"

    @property
    def error_feedback(self) -> bool:
        return self.variant == "error_feedback"


@dataclass(frozen=True)
class TwoBit:
    """Codes +1 (acc >= threshold), -1 (acc <= -threshold), 0; the sum of the codes times the
    threshold; the residual is acc less code*threshold."""
    threshold: Fraction
    error_feedback = True
    scope = "bucket"


def largest(values: Vector, k: int) -> List[int]:
    """Indices (ascending) of the k largest |values|; equal magnitudes: the lower index."""
    order = sorted(range(len(values)), key=lambda i: (-abs(values[i]), i))
    return sorted(order[:k])


def encode(comp, acc: Vector, step: int, key: str) -> Tuple[Dict[int, Fraction], Vector]:
    """What one rank sends of ``acc`` (index -> value) and what it keeps."""
    n = len(acc)
    if isinstance(comp, TwoBit):
        codes = [1 if a >= comp.threshold else -1 if a <= -comp.threshold else 0 for a in acc]
        sent = {i: c * comp.threshold for i, c in enumerate(codes) if c}
        return sent, [a - c * comp.threshold for a, c in zip(acc, codes)]
    if isinstance(comp, TopK):
        chosen = largest(acc, comp.k(n, step))
        scale = 1
    else:
        k = min(n, max(1, int(comp.density * n)))
        rng = np.random.default_rng([comp.seed, step, zlib.crc32(key.encode())])
        chosen = sorted(int(i) for i in rng.choice(n, k, replace=False))
        scale = 1 if comp.error_feedback else Fraction(n, k)
    residual = list(acc)
    for i in chosen:
        residual[i] = Fraction(0)
    return {i: acc[i] * scale for i in chosen}, residual


def gtopk_tree(sent: Sequence[Dict[int, Fraction]], k: int
               ) -> Tuple[Dict[int, Fraction], List[Dict[int, Fraction]]]:
    """ALGORITHMS.md's gTopKAllReduce: in round r a rank that is a multiple of 2^(r+1) merges
    what rank + 2^r holds into its own (values at a common index summed), keeping the k
    largest |sums| (ties: the lower index). Returns rank 0's result and, per rank, its pairs
    that did not reach it (they go back to its residual)."""
    size = len(sent)
    # per rank: index -> (value, [(owner, its value), ...]); a dropped pair leaves no trace
    held = [{i: (v, [(q, v)]) for i, v in s.items()} for q, s in enumerate(sent)]
    step = 1
    while step < size:
        for q in range(0, size, 2 * step):
            if q + step < size:
                merged = dict(held[q])
                for i, (v, owners) in held[q + step].items():
                    if i in merged:
                        merged[i] = (merged[i][0] + v, merged[i][1] + owners)
                    else:
                        merged[i] = (v, owners)
                indices = sorted(merged)
                keep = largest([merged[i][0] for i in indices], k) if len(indices) > k \
                    else range(len(indices))
                held[q] = {indices[j]: merged[indices[j]] for j in keep}
        step *= 2
    result = {i: v for i, (v, _) in held[0].items()}
    reached = {(q, i) for i, (_, owners) in held[0].items() for q, _ in owners}
    lost = [{i: v for i, v in s.items() if (q, i) not in reached} for q, s in enumerate(sent)]
    return result, lost


def reduce(comp, sent: Sequence[Dict[int, Fraction]], n: int, step: int
           ) -> Tuple[Vector, List[Dict[int, Fraction]]]:
    """The sum over the ranks (dense), and what each rank gets back for its residual."""
    if isinstance(comp, TopK) and comp.tree:
        result, lost = gtopk_tree(sent, comp.k(n, step))
    else:
        result, lost = {}, [{} for _ in sent]
        for s in sent:
            for i, v in s.items():
                result[i] = result.get(i, 0) + v
    return [Fraction(result.get(i, 0)) for i in range(n)], lost


def buckets(comp, names: Sequence[str]) -> List[List[str]]:
    """How the parameters are grouped for the compressor: scope "layer" one bucket each,
    "model" (and "bucket" with every parameter in one fusion bucket) one bucket of all, in
    reverse registration order (the backward order)."""
    if comp is not None and comp.scope == "layer":
        return [[n] for n in reversed(names)]
    return [list(reversed(names))]


# -- delayed synchronisation -------------------------------------------------------------------
@dataclass(frozen=True)
class DelaySpec:
    """docs/methods/delayed.md's table: ``mode`` od-sgd, ssd-sgd or cd-sgd; ``local_lr``
    None: the group's."""
    mode: str
    warmup_steps: int
    k: int = 5
    local_lr: Optional[Fraction] = None
    dcasgd: bool = False
    dc_lambda: Fraction = Fraction(0)
    glu: Fraction = Fraction(1)

    def is_reset(self, j: int) -> bool:
        return self.mode != "ssd-sgd" or j % self.k == 0

    def full_precision(self, j: int) -> bool:
        return self.mode == "cd-sgd" and (j + 1) % self.k == 0


@dataclass
class Snapshot:
    """After one step: each rank's local weights and residuals (by parameter), and the
    global weights W (None without delay=)."""
    local: List[Dict[str, Vector]]
    W: Optional[Dict[str, Vector]]
    residuals: List[Dict[str, Vector]]


class Simulation:
    """P ranks training the quadratic loss with ``sgd`` (the wrapped optimizer), compressed
    by ``comp`` (None: dense) and, with ``delay``, delayed as docs/methods/delayed.md's table says;
    ``curved`` and ``spread``: the data (h in {0, 1} or 0; c in [-spread, spread])."""

    def __init__(self, size: int, shapes: Shapes, sgd: SGD, comp=None,
                 delay: Optional[DelaySpec] = None, curved: bool = True, spread: int = 4):
        self.size, self.shapes, self.names = size, shapes, list(shapes)
        self.spread = spread
        self.sgd, self.comp, self.delay = sgd, comp, delay
        self.h = {n: curvature(n, numel(s), curved) for n, s in shapes.items()}
        start = initial_weights(shapes)
        self.local = [{n: list(v) for n, v in start.items()} for _ in range(size)]
        self.W = {n: list(v) for n, v in start.items()}
        self.buf: Dict[str, Optional[Vector]] = {n: None for n in shapes}
        self.residuals: List[Dict[str, Vector]] = [{} for _ in range(size)]
        self.pending = None   # the last delayed step's (average, what goes back to residuals)
        self.step_index = 0

    # one step of every rank
    def step(self) -> Snapshot:
        s, P = self.step_index, self.size
        grads = [{n: gradient(P, coefficients(r, s, n, numel(self.shapes[n]), self.spread),
                              self.h[n], self.local[r][n]) for n in self.names}
                 for r in range(P)]
        d = self.delay
        warming = d is None or s < d.warmup_steps
        dense = self.comp is None or (d is not None and (warming or d.full_precision(
            s - d.warmup_steps)))
        average, lost = self._communicate(grads, s, dense)
        if d is None or warming:
            self._settle(lost)
            for n in self.names:
                new, self.buf[n] = self.sgd.step(self.local[0][n], average[n], self.buf[n])
                for r in range(P):
                    self.local[r][n] = list(new)
                self.W[n] = list(new)
        else:
            self._delayed(grads, s - d.warmup_steps)
            self.pending = (average, lost)
        self.step_index += 1
        return self.snapshot()

    def _communicate(self, grads, s, dense):
        """Every rank's compensate -> compress -> keep the residual; the sum; the average."""
        if dense:
            return {n: [sum(g[n][i] for g in grads) / self.size
                        for i in range(len(grads[0][n]))] for n in self.names}, None
        average, lost = {}, [{} for _ in grads]
        for group in buckets(self.comp, self.names):
            key = "|".join(group)
            sent = []
            for r, g in enumerate(grads):
                acc = [x for n in group for x in g[n]]
                if self.comp.error_feedback:
                    acc = [a + e for a, e in zip(acc, self._flat(r, group))]
                payload, residual = encode(self.comp, acc, s, key)
                if self.comp.error_feedback:
                    self._store(r, group, residual)
                sent.append(payload)
            total, back = reduce(self.comp, sent, len(acc), s)
            for r, b in enumerate(back):
                lost[r][key] = (group, b)
            for n, part in self._split(group, total):
                average[n] = [t / self.size for t in part]
        return average, lost

    def _flat(self, r, group):
        return [x for n in group
                for x in self.residuals[r].get(n, [Fraction(0)] * numel(self.shapes[n]))]

    def _split(self, group, flat):
        at = 0
        for n in group:
            m = numel(self.shapes[n])
            yield n, flat[at:at + m]
            at += m

    def _store(self, r, group, flat):
        for n, part in self._split(group, flat):
            self.residuals[r][n] = list(part)

    def _settle(self, lost):
        """What did not reach the result (gTop-k) goes back into the residual as it is now."""
        if lost is None:
            return
        for r, by_key in enumerate(lost):
            for group, back in by_key.values():
                if back:
                    flat = self._flat(r, group)
                    for i, v in back.items():
                        flat[i] += v
                    self._store(r, group, flat)

    def _delayed(self, grads, j):
        """Last step's average advances W (the wrapped optimizer, its momentum going on from
        the warm-up); the local weights move with this rank's own gradient."""
        d = self.delay
        reset = d.is_reset(j)
        W_before = None
        if self.pending is not None:
            average, lost = self.pending
            self._settle(lost)
            self.pending = None
            W_before = {n: list(v) for n, v in self.W.items()}
            for n in self.names:
                self.W[n], self.buf[n] = self.sgd.step(self.W[n], average[n], self.buf[n])
        lr = d.local_lr if d.local_lr is not None else self.sgd.lr
        wd = self.sgd.weight_decay
        for r in range(self.size):
            for n in self.names:
                w, g, W = self.local[r][n], grads[r][n], self.W[n]
                if reset:  # w <- W - lr*(g + wd*W + dc), dc = lambda*g*g*(W - w) (DC-ASGD)
                    dc = [d.dc_lambda * gi * gi * (Wi - wi) if d.dcasgd else 0
                          for gi, Wi, wi in zip(g, W, w)]
                    new = [Wi - lr * (gi + wd * Wi + ci) for Wi, gi, ci in zip(W, g, dc)]
                else:      # w - lr*(g + wd*w) + glu*(W - W_before) (SSD-SGD's GLU)
                    glu = [d.glu * (Wi - Bi) for Wi, Bi in zip(W, W_before[n])] \
                        if W_before is not None else [0] * len(w)
                    new = [wi - lr * (gi + wd * wi) + ui for wi, gi, ui in zip(w, g, glu)]
                self.local[r][n] = new

    def finish_pending(self) -> Snapshot:
        """The last average advances W; every rank's local weights become W."""
        if self.pending is not None:
            average, lost = self.pending
            self._settle(lost)
            self.pending = None
            for n in self.names:
                self.W[n], self.buf[n] = self.sgd.step(self.W[n], average[n], self.buf[n])
        for r in range(self.size):
            self.local[r] = {n: list(v) for n, v in self.W.items()}
        return self.snapshot()

    def snapshot(self) -> Snapshot:
        copy = lambda by_name: {n: list(v) for n, v in by_name.items()}  # noqa: E731
        return Snapshot([copy(x) for x in self.local],
                        copy(self.W) if self.delay is not None else None,
                        [copy(x) for x in self.residuals])
