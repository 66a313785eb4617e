"""What a method's prediction reads (:class:`Case`), and the methods' settings declared once
(:class:`Settings`): the simulator's cases, the advisor and the replay all take one."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from collectives.errors import HvcommError

from .compressor import check_density


@dataclass(frozen=True, kw_only=True)
class Settings:
    """The methods' settings, hvcomm's defaults unless given: what each method's prediction
    models (:class:`Case`) and what it runs with in a replay
    (:meth:`hvcomm.torch.methods.base.Method.optimizer_options`)."""

    density: float = 0.001           # the sparse methods' share of the gradient sent
    threshold_bytes: int = 25 << 20  # the fusion threshold: DDP's 25 MiB buckets
    slice_elems: int = 50_000        # P3's slice
    delay_k: int = 5                 # the delayed methods' k: CD-SGD's full-precision
                                     # steps, SSD-SGD's resets, every k-th
    rank: int = 4                    # PowerSGD's rank
    period: int = 16                 # local SGD's and DiLoCo's steps between averages
    warmup_steps: int = 100          # the delayed methods' synchronous steps first
    trial_steps: int = 5             # the raced schedules' steps per candidate

    def __post_init__(self):
        check_density(self.density)
        counts = {"threshold_bytes": 0, "slice_elems": 1, "delay_k": 1, "rank": 1,
                  "period": 1, "warmup_steps": 0, "trial_steps": 1}
        for name, least in counts.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise HvcommError(f"{name} must be an integer >= {least}, got {value!r}")


@dataclass(frozen=True)
class Case:
    """One prediction's input (built by :func:`hvcomm.sim.simulate.iteration`): one worker's
    ``trace`` (a :class:`hvcomm.sim.simulate.LayerTrace`), the ``cluster`` of more than one
    worker (a :class:`hvcomm.sim.simulate.Cluster`: nodes of GPUs, the links inside and between
    them), the local ``compute`` costs per element (:class:`hvcomm.sim.simulate.ComputeCost`),
    the methods' ``settings``, and ``local_s``: a measured per-iteration local cost that replaces
    the modelled one (None: modelled). A prediction prices its dense allreduces with
    :meth:`allreduce_s` (hierarchical where a node has several GPUs); a method whose
    collective takes another form on nodes of several GPUs reads ``cluster``'s links."""

    trace: Any
    cluster: Any
    compute: Any
    settings: Settings
    local_s: Optional[float] = None

    @property
    def workers(self) -> int:
        return self.cluster.workers

    def allreduce_s(self, nbytes: float) -> float:
        """A dense allreduce of ``nbytes`` over every worker of the cluster."""
        return self.cluster.allreduce_s(nbytes)

    def local(self, modelled_s: float = 0.0) -> float:
        """The local cost on the critical path: measured if given, else ``modelled_s``."""
        return self.local_s if self.local_s is not None else modelled_s

    @property
    def k(self) -> int:
        """Top-k's k for the whole model at ``density``."""
        return max(int(self.settings.density * self.trace.params), 1)
