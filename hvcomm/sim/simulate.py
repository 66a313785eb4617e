"""Iteration time of every method at any number of workers, from a per-layer trace (no MPI
calls, no MPI library needed).

A :class:`LayerTrace` gives, for one iteration of one worker, each layer's parameters and its
forward and backward time. A :class:`Network` gives the alpha-beta cost of a message over one
link: the network between nodes (:data:`NETWORKS`) or the link between the GPUs of a node
(:data:`INTRA_LINKS`). A :class:`Cluster` is where the workers run: nodes of GPUs, one worker
per GPU, and those two links. From them :func:`iteration` predicts one method's iteration time
on the cluster: each method's module (:mod:`hvcomm.torch.methods`) holds its own prediction
(``predict``), for example the planned schedules' pipeline with the cluster's allreduce cost
(the ring, or the hierarchical allreduce on nodes of several GPUs: wfbp, single, threshold,
merge_rule, mgwfbp), one message of k pairs after backward plus the selection and merging
(topk, gtopk), P3's event simulation of priority slices, or the delayed methods' allreduce
hidden behind the next iteration's computation.

Compute costs per element (:class:`ComputeCost`) come from the trace's device: figures
measured on hvcomm's development machine for a CPU trace, a stated assumption for a GPU trace
(:data:`COMPUTE`); a caller can pass its own. Every figure says where it comes from
(``source``, beginning with "measured" or "assumed"; a trace's ``measured_on``), and the
advisor prints them.
Scaling efficiency is the iteration time of one worker (computation only) over the iteration
time at P, i.e. throughput(P) / (P * throughput(1)).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from collectives.cost import AlphaBeta, hierarchical_allreduce_s
from collectives.errors import HvcommError
from hvcomm.cluster.netem import check_dilation
from hvcomm.torch import methods
from hvcomm.torch.methods.case import Case, Settings

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
    communication, the batch per worker, and where the times come from (``source``; and
    ``measured_on``, the machine that measured them, or "" for an estimate).
    :mod:`hvcomm.sim.profile` measures one for a model of one's own."""

    model: str
    layers: Tuple[Layer, ...]
    batch: int
    update_s: float = 0.0
    bytes_per_param: int = 4
    source: str = ""
    device: str = "cpu"      # what ran it, "cpu" or "gpu": picks the local costs (COMPUTE)
    measured_on: str = ""    # the machine that measured the times ("": estimated)

    @property
    def compute_s(self) -> float:
        """Forward, backward and update of one worker with no communication."""
        return sum(layer.forward_s + layer.backward_s for layer in self.layers) + self.update_s

    @property
    def params(self) -> int:
        return sum(layer.params for layer in self.layers)

    def dilated(self, factor: float) -> "LayerTrace":
        """This trace with every time (forward, backward, update) ``factor`` times longer: with
        the links ``factor`` times slower (:class:`hvcomm.cluster.netem.EmulatedCluster`'s
        ``dilate``) an iteration takes ``factor`` times as long, less the share of the
        host's own CPU work, which does not stretch."""
        check_dilation(factor)
        if factor == 1:
            return self
        return replace(self, layers=tuple(replace(layer, forward_s=layer.forward_s * factor,
                                                  backward_s=layer.backward_s * factor)
                                          for layer in self.layers),
                       update_s=self.update_s * factor,
                       source=f"{self.source}; every time dilated {factor:g}x")

    def planner_trace(self) -> planner.Trace:
        """The planner's view: gradients in backward order (last layer first), each ready when
        its layer's backward ends."""
        t = sum(layer.forward_s for layer in self.layers)
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

    def save(self, path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    def to_dict(self) -> dict:
        """The JSON layout that :meth:`from_dict` reads."""
        return {"model": self.model, "batch": self.batch, "bytes_per_param": self.bytes_per_param,
                "device": self.device, "measured_on": self.measured_on,
                "update_s": self.update_s, "source": self.source,
                "layers": [{"name": layer.name, "shapes": [list(s) for s in layer.shapes],
                            "params": layer.params, "forward_s": layer.forward_s,
                            "backward_s": layer.backward_s} for layer in self.layers]}

    @classmethod
    def from_dict(cls, data: dict) -> "LayerTrace":
        """A trace from the JSON layout of hvcomm/sim/traces (scripts/make_traces.py)."""
        layers = tuple(Layer(layer["name"], int(layer["params"]), float(layer["forward_s"]),
                             float(layer["backward_s"]),
                             tuple(tuple(int(n) for n in shape)
                                   for shape in layer.get("shapes", ())))
                       for layer in data["layers"])
        return cls(data["model"], layers, int(data["batch"]), float(data.get("update_s", 0.0)),
                   int(data.get("bytes_per_param", 4)), data.get("source", ""),
                   data.get("device", "cpu"), data.get("measured_on", ""))


def available_traces() -> List[str]:
    return sorted(p.stem for p in TRACES.glob("*.json"))


@dataclass(frozen=True)
class Network:
    """Per-message latency and bandwidth (per direction) of one link: a node's port to the
    network between nodes, or a GPU's link to the others of its node. ``source``: where the
    figures come from, beginning with "measured" or "assumed"."""

    name: str
    alpha_s: float
    bandwidth_bit_s: float
    source: str = ""

    @property
    def alpha_beta(self) -> AlphaBeta:
        return AlphaBeta.from_link(self.alpha_s, self.bandwidth_bit_s)


_ETHERNET = ("assumed: the nominal line rate, and a latency typical of MPI over TCP on Ethernet "
             "(tens of microseconds); not measured")
# between nodes: one port per node
NETWORKS = {
    "1gbit": Network("1gbit", 50e-6, 1e9, _ETHERNET),
    "10gbit": Network("10gbit", 30e-6, 10e9, _ETHERNET),
    "25gbit": Network("25gbit", 20e-6, 25e9, _ETHERNET),
    "100gbit": Network("100gbit", 10e-6, 100e9, _ETHERNET),
    "ib-edr": Network("ib-edr", 2e-6, 100e9, "assumed: InfiniBand EDR's 100 Gbit/s line rate "
                      "and a verbs latency of 2 us; not measured"),
}

_LINK_LATENCY = "a latency of a few microseconds per message (assumed)"


def _nvlink(generation: int, board: str, links: int, both_ways_gb_s: float) -> Network:
    """A GPU's NVLink to the others of its node; NVIDIA's datasheets count both directions."""
    return Network(f"nvlink{generation}", 3e-6, both_ways_gb_s / 2 * 8e9,
                   f"assumed, from vendor spec: {board}, {links} NVLink {generation} links, "
                   f"{both_ways_gb_s:g} GB/s both directions together (NVIDIA's datasheet), "
                   f"{both_ways_gb_s / 2:g} GB/s each way; {_LINK_LATENCY}")


def _pcie(version: int, lane_gt_s: float) -> Network:
    """A GPU's PCIe x16 link (128b/130b coding from PCIe 3.0 on)."""
    each_way_gb_s = lane_gt_s * 16 * 128 / 130 / 8
    return Network(f"pcie{version}", 5e-6, each_way_gb_s * 8e9,
                   f"assumed, from the PCIe {version}.0 spec: x16 at {lane_gt_s:g} GT/s a lane, "
                   f"{each_way_gb_s:.2f} GB/s each way, each GPU's link carrying only its own "
                   "traffic (peer to peer under one switch; less through the CPU); "
                   f"{_LINK_LATENCY}")


# inside a node: each GPU's link to the others, per direction. Peak figures, assumed from the
# vendors' specifications and not measured here: what a ring achieves on them is lower.
INTRA_LINKS = {link.name: link for link in (
    _nvlink(2, "V100 SXM2", 6, 300), _nvlink(3, "A100 SXM4", 12, 600),
    _nvlink(4, "H100 SXM5", 18, 900), _pcie(3, 8), _pcie(4, 16))}

DEFAULT_GPU = "v100"   # the GPU of the shipped traces when none is named
_NVLINK_OF = {"v100": "nvlink2", "a100": "nvlink3"}   # their SXM boards' NVLink


def default_intra(gpu: Optional[str]) -> str:
    """The link inside a node for a shipped trace's GPU: its SXM board's NVLink; PCIe 3.0 for
    another GPU or for a trace that names none."""
    return _NVLINK_OF.get(gpu or "", "pcie3")


def network(name: str) -> Network:
    if name not in NETWORKS:
        raise HvcommError(f"unknown network {name!r}; choose one of {sorted(NETWORKS)}")
    return NETWORKS[name]


def intra_link(name: str) -> Network:
    if name not in INTRA_LINKS:
        raise HvcommError(f"unknown intra-node link {name!r}; choose one of {sorted(INTRA_LINKS)}")
    return INTRA_LINKS[name]


@dataclass(frozen=True)
class Cluster:
    """Where the workers run: ``nodes`` nodes of ``gpus_per_node`` GPUs, one worker per GPU;
    the GPUs of a node joined by the ``intra`` link (needed with more than one GPU per node),
    the nodes by the ``inter`` network, one port per node."""

    nodes: int
    gpus_per_node: int
    inter: Network
    intra: Optional[Network] = None

    def __post_init__(self):
        for what in ("nodes", "gpus_per_node"):
            value = getattr(self, what)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise HvcommError(f"{what} must be a whole number >= 1, got {value!r}")
        if self.gpus_per_node > 1 and self.intra is None:
            raise HvcommError(f"{self.gpus_per_node} GPUs per node need the link between them: "
                              f"one of {sorted(INTRA_LINKS)}")

    @classmethod
    def flat(cls, workers: int, inter: Network) -> "Cluster":
        """``workers`` hosts of one GPU each on one network."""
        return cls(workers, 1, inter)

    @property
    def workers(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def inter_ab(self) -> AlphaBeta:
        return self.inter.alpha_beta

    @property
    def intra_ab(self) -> AlphaBeta:
        """The intra link's cost (free with one GPU per node: nothing crosses it)."""
        return self.intra.alpha_beta if self.intra is not None else AlphaBeta(0.0, 0.0)

    def allreduce_s(self, nbytes: float) -> float:
        """A dense allreduce over every worker: the ring with one GPU per node, else the
        hierarchical form (:func:`collectives.cost.hierarchical_allreduce_s`)."""
        return hierarchical_allreduce_s(self.nodes, self.gpus_per_node, nbytes, self.intra_ab,
                                        self.inter_ab)

    def describe(self) -> str:
        if self.gpus_per_node == 1:
            return f"{self.workers} workers (one GPU per node) on {self.inter.name}"
        return (f"{self.nodes} node{'s' if self.nodes > 1 else ''} x {self.gpus_per_node} GPUs "
                f"({self.workers} workers): {self.intra.name} inside a node, {self.inter.name} "
                "between nodes")


@dataclass(frozen=True)
class ComputeCost:
    """Local compute of the sparse methods, seconds per element; ``source``: where the figures
    come from, beginning with "measured" or "assumed"."""

    select_s_per_element: float   # top-k of d gradients (threshold and mask)
    merge_s_per_pair: float       # gTop-k tree step: merge, sum, select, per input pair
    sum_s_per_pair: float         # AllGather: summing the P*k gathered pairs
    source: str = ""


COMPUTE = {
    "cpu": ComputeCost(4.0e-9, 1.5e-8, 1.0e-8,
                       "measured on hvcomm's development machine (one x86_64 core), not on "
                       "yours: scripts/bench_selection.py (top-k of d=25M: ~0.1 s) and the "
                       "compute columns of results/collectives_shm.md (gTop-k P=2: 0.79 ms for "
                       "2k=52K pairs)"),
    "gpu": ComputeCost(4.0e-10, 1.5e-9, 1.0e-9,
                       "assumed: a tenth of the CPU's per-element time (memory-bound kernels "
                       "at ~10x the bandwidth); not measured"),
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


def case(trace: LayerTrace, cluster: Cluster, settings: Optional[Settings] = None, *,
         compute: Optional[ComputeCost] = None, local_s: Optional[float] = None) -> Case:
    """What a method's ``predict`` reads. ``settings``: the methods' (:class:`Settings`;
    default hvcomm's). ``compute`` defaults to the costs of the trace's device
    (:data:`COMPUTE`). ``local_s``: a measured
    per-iteration cost beyond the trace on one worker (the method's selection and error
    feedback, the framework's hooks and update), e.g. a replay on a one-rank communicator
    minus the trace (scripts/replay.py runs P of them at once, sharing the cores as the P
    workers do); it then stands in for the modelled local cost, and is on the critical path."""
    if settings is not None and not isinstance(settings, Settings):
        raise HvcommError(f"settings must be a simulate.Settings, got {settings!r}")
    return Case(trace, cluster, compute or COMPUTE[trace.device],
                settings if settings is not None else Settings(), local_s=local_s)


def unmodelled(method: str, c: Case) -> Optional[str]:
    """Why ``method`` has no prediction for the case ``c`` (None: it has one)."""
    m = methods.get(method)
    if not m.simulated:
        return f"the simulator has no row for {method!r}; choose one of {METHODS}"
    return m.unmodelled(c) if c.workers > 1 else None


def iteration(method: str, trace: LayerTrace, cluster: Cluster,
              settings: Optional[Settings] = None, **case_kw) -> Prediction:
    """Predicted iteration time of ``method`` on ``cluster`` (the method module's
    ``predict``) with ``settings``; ``case_kw``: :func:`case`'s ``compute`` and ``local_s``. A
    method without a prediction there is refused with the reason (:func:`unmodelled`)."""
    c = case(trace, cluster, settings, **case_kw)
    why = unmodelled(method, c)
    if why:
        raise HvcommError(f"no prediction for {method!r} on {cluster.describe()}: {why}")
    base = trace.compute_s
    if cluster.workers == 1:  # one worker communicates and compresses nothing
        return Prediction(method, 1, base + c.local(), base, trace.batch)
    return Prediction(method, cluster.workers, methods.get(method).predict(c), base, trace.batch)


def compare(trace: LayerTrace, cluster: Cluster, names: Sequence[str] = METHODS,
            settings: Optional[Settings] = None,
            **case_kw) -> Tuple[List[Prediction], Dict[str, str]]:
    """The predictions of the methods ``names`` with ``settings``, fastest first, and why
    those left out have none."""
    c = case(trace, cluster, settings, **case_kw)
    left_out = {name: why for name in names if (why := unmodelled(name, c))}
    ranked = [iteration(name, trace, cluster, settings, **case_kw) for name in names
              if name not in left_out]
    return sorted(ranked, key=lambda r: r.iteration_s), left_out
