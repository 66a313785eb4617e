"""Iteration time of every method at any number of workers, from a per-layer trace (no MPI
calls, no MPI library needed).

A :class:`LayerTrace` gives, for one iteration of one worker, each layer's parameters and its
forward and backward time. A :class:`Network` gives the alpha-beta cost of a message. From
them :func:`iteration` predicts one method's iteration time at P workers: each method's module
(:mod:`hvcomm.torch.methods`) holds its own prediction (``predict``), for example the planned
schedules' pipeline with the ring allreduce's cost at P (wfbp, single, threshold, merge_rule,
mgwfbp), one message of k pairs after backward plus the selection and merging (topk, gtopk),
P3's event simulation of priority slices, or the delayed methods' allreduce hidden behind the
next iteration's computation.

Compute costs per element (:class:`ComputeCost`) come from the trace's device: this
machine's measured figures for a CPU trace, a stated assumption for a GPU trace (:data:`COMPUTE`);
a caller can pass its own.
Scaling efficiency is the iteration time of one worker (computation only) over the iteration
time at P, i.e. throughput(P) / (P * throughput(1)).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from collectives.cost import AlphaBeta
from collectives.errors import HvcommError
from hvcomm.torch import methods
from hvcomm.torch.methods.base import Case

from .. import planner

METHODS = tuple(m.name for m in methods.REGISTRY.values() if m.simulated)
TRACES = Path(__file__).resolve().parent / "traces"


@dataclass(frozen=True)
class Layer:
    name: str
    params: int
    forward_s: float
    backward_s: float
    shapes: Tuple[Tuple[int, ...], ...] = ()   # its parameter tensors' shapes, if known

    def tensors(self) -> Tuple[Tuple[int, ...], ...]:
        """Its parameter tensors' shapes; where unknown, one tensor of all its parameters."""
        return self.shapes or (((self.params,),) if self.params else ())


@dataclass(frozen=True)
class LayerTrace:
    """One worker's iteration: layers in forward order, the optimizer update after
    communication, the batch per worker, and where the times come from."""

    model: str
    layers: Tuple[Layer, ...]
    batch: int
    update_s: float = 0.0
    bytes_per_param: int = 4
    source: str = ""
    device: str = "cpu"      # where the times come from: "cpu" (measured here) or "gpu"

    @property
    def compute_s(self) -> float:
        """Forward, backward and update of one worker with no communication."""
        return sum(l.forward_s + l.backward_s for l in self.layers) + self.update_s

    @property
    def params(self) -> int:
        return sum(l.params for l in self.layers)

    def planner_trace(self) -> planner.Trace:
        """The planner's view: gradients in backward order (last layer first), each ready when
        its layer's backward ends."""
        t = sum(l.forward_s for l in self.layers)
        ready, nbytes = [], []
        for layer in reversed(self.layers):
            t += layer.backward_s
            if layer.params:
                ready.append(t)
                nbytes.append(layer.params * self.bytes_per_param)
        return planner.Trace(tuple(ready), tuple(nbytes), self.update_s, backward_end_s=t)

    @classmethod
    def named(cls, name: str) -> "LayerTrace":
        """A trace by file path (``*.json``) or by name in hvcomm/sim/traces (``resnet50-v100``)."""
        path = Path(name) if name.endswith(".json") else TRACES / f"{name}.json"
        if not path.exists():
            raise HvcommError(f"no trace {name!r}; available in hvcomm/sim/traces: "
                              f"{', '.join(available_traces())} (scripts/make_traces.py adds more)")
        return cls.load(path)

    @classmethod
    def load(cls, path) -> "LayerTrace":
        return cls.from_dict(json.loads(Path(path).read_text()))

    @classmethod
    def from_dict(cls, data: dict) -> "LayerTrace":
        """A trace from the JSON layout of hvcomm/sim/traces (scripts/make_traces.py)."""
        layers = tuple(Layer(l["name"], int(l["params"]), float(l["forward_s"]),
                             float(l["backward_s"]),
                             tuple(tuple(int(n) for n in shape) for shape in l.get("shapes", ())))
                       for l in data["layers"])
        return cls(data["model"], layers, int(data["batch"]), float(data.get("update_s", 0.0)),
                   int(data.get("bytes_per_param", 4)), data.get("source", ""),
                   data.get("device", "cpu"))


def available_traces() -> List[str]:
    return sorted(p.stem for p in TRACES.glob("*.json"))


@dataclass(frozen=True)
class Network:
    """Per-message latency and link bandwidth between workers (one link per worker)."""

    name: str
    alpha_s: float
    bandwidth_bit_s: float

    @property
    def alpha_beta(self) -> AlphaBeta:
        return AlphaBeta.from_link(self.alpha_s, self.bandwidth_bit_s)


# latencies: typical MPI-over-TCP small-message latency on Ethernet (tens of microseconds),
# and verbs latency on InfiniBand EDR; assumptions, stated, not measured here
NETWORKS = {
    "1gbit": Network("1gbit", 50e-6, 1e9),
    "10gbit": Network("10gbit", 30e-6, 10e9),
    "25gbit": Network("25gbit", 20e-6, 25e9),
    "100gbit": Network("100gbit", 10e-6, 100e9),
    "ib-edr": Network("ib-edr", 2e-6, 100e9),
}


def network(name: str) -> Network:
    if name not in NETWORKS:
        raise HvcommError(f"unknown network {name!r}; choose one of {sorted(NETWORKS)}")
    return NETWORKS[name]


@dataclass(frozen=True)
class ComputeCost:
    """Local compute of the sparse methods, seconds per element."""

    select_s_per_element: float   # top-k of d gradients (threshold and mask)
    merge_s_per_pair: float       # gTop-k tree step: merge, sum, select, per input pair
    sum_s_per_pair: float         # AllGather: summing the P*k gathered pairs


COMPUTE = {
    # this machine, one core: bench_selection.py (d=25M: ~0.1 s) and the compute columns of
    # results/collectives_shm.md (gTop-k P=2: 0.79 ms for 2k=52K pairs)
    "cpu": ComputeCost(4.0e-9, 1.5e-8, 1.0e-8),
    # a GPU: selection and merging at about a tenth of the CPU's per-element time (an
    # assumption: memory-bound kernels at ~10x the bandwidth), not measured here
    "gpu": ComputeCost(4.0e-10, 1.5e-9, 1.0e-9),
}
@dataclass(frozen=True)
class Prediction:
    method: str
    workers: int
    iteration_s: float
    compute_s: float        # one worker's computation (the P=1 iteration)
    batch: int

    @property
    def throughput(self) -> float:
        """Samples per second over all workers."""
        return self.workers * self.batch / self.iteration_s

    @property
    def efficiency(self) -> float:
        return self.compute_s / self.iteration_s


def iteration(method: str, trace: LayerTrace, workers: int, net: Network,
              density: float = 0.001, compute: Optional[ComputeCost] = None,
              threshold_bytes: int = 25 << 20, local_s: Optional[float] = None,
              slice_elems: int = 50_000, delay_k: int = 5) -> Prediction:
    """Predicted iteration time of ``method`` at ``workers`` (the method module's
    ``predict``). ``compute`` defaults to the costs of the trace's device (:data:`COMPUTE`).
    ``density``: the sparse methods'; ``slice_elems``: P3's slice; ``delay_k``: CD-SGD's
    full-precision period (hvcomm's defaults). ``local_s``: a measured per-iteration cost
    beyond the trace on one worker (the method's selection and error feedback, the
    framework's hooks and update), e.g. a replay on a one-rank communicator minus the trace
    (scripts/replay.py runs P of them at once, sharing the cores as the P workers do); it then
    stands in for the modelled local cost, and is on the critical path."""
    m = methods.get(method)
    if not m.simulated:
        raise HvcommError(f"the simulator has no row for {method!r}; choose one of {METHODS}")
    if workers < 1:
        raise HvcommError(f"workers must be >= 1, got {workers}")
    if not 0 < density <= 1:
        raise HvcommError(f"density must be in (0, 1], got {density}")
    if slice_elems < 1 or delay_k < 1:
        raise HvcommError(f"slice_elems and delay_k must be >= 1, got {slice_elems}, {delay_k}")
    base = trace.compute_s
    if workers == 1:  # one worker communicates and compresses nothing
        return Prediction(method, 1, base + (local_s or 0.0), base, trace.batch)
    case = Case(trace, workers, net.alpha_beta, compute or COMPUTE[trace.device], density,
                threshold_bytes, slice_elems, delay_k, local_s=local_s)
    return Prediction(method, workers, m.predict(case), base, trace.batch)


def compare(trace: LayerTrace, workers: int, net: Network, density: float = 0.001,
            compute: Optional[ComputeCost] = None,
            methods: Sequence[str] = METHODS) -> List[Prediction]:
    """Every method's prediction, fastest first."""
    return sorted((iteration(m, trace, workers, net, density, compute) for m in methods),
                  key=lambda r: r.iteration_s)
