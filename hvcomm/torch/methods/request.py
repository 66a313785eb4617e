"""What every method's ``problem(request) -> Optional[str]`` judges."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch


@dataclass(frozen=True)
class Request:
    """What every method's ``problem(request) -> Optional[str]`` judges (its first reason it
    cannot serve, on this rank, or None): the DistributedOptimizer's options
    (:class:`hvcomm.torch.options.Options`; None where a compressor alone is asked), the
    parameters it trains, the number of ranks that average them and the optimizer given to
    wrap."""
    options: Any = None
    params: Sequence[torch.nn.Parameter] = ()
    size: int = 1
    optimizer: Any = None

    @property
    def dtypes(self) -> set:
        return {p.dtype for p in self.params}
