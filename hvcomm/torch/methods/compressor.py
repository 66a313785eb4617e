"""The compressor: how a gradient is encoded into a payload, summed by its collective and
decoded, with Horovod's ``compress``/``decompress`` on top; and the checks compressors share."""
from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import numpy as np
import torch

from collectives.errors import HvcommError

from .payload import ALLREDUCE, Allreduce, Collective, Payload
from .request import Request


class Compressor:
    """A compressor: ``encode`` a flat gradient into a :class:`Payload` whose ``collective``
    sums it over the ranks, then ``decode`` the result into the dense sum. ``scope``:
    "layer" (each tensor alone), "model" (one buffer for the whole model) or "bucket" (the
    optimizer's fusion buckets). ``error_feedback``: what was not sent is kept
    (:mod:`hvcomm.torch.methods.memory`) and added to the next step's gradient.

    Horovod's interface is kept on top: ``compress(tensor) -> (data, ctx)`` and
    ``decompress(data, ctx)``, ctx being the payload."""

    collective: Collective = ALLREDUCE
    scope = "bucket"
    error_feedback = False
    sends_as_is = False   # True for the identity (dense gradients as they are)

    def encode(self, tensor: torch.Tensor, step: int = 0, key: str = "",
               shapes: Sequence[Tuple[int, ...]] = (), names: Sequence[str] = ()) -> Payload:
        """``tensor``: a flat gradient (a bucket's), at synchronisation ``step``; ``key``
        names the bucket; ``shapes`` and ``names``: its parameters', in order (empty if
        unknown)."""
        raise NotImplementedError

    def decode(self, result: Any, payload: Payload) -> torch.Tensor:
        """The dense sum, in a tensor the caller owns (the optimizer scales it in place, or
        the dense allreduce has, for a compressor that ``sends_as_is``), in the dtype of the
        tensor ``encode`` was given."""
        raise NotImplementedError

    def gather_dtype(self, params: Sequence[torch.Tensor]) -> Optional[torch.dtype]:
        """The dtype the optimizer gathers these parameters' gradients in for ``encode``
        (None: their own). A compressor whose ``encode`` begins by casting names the cast's
        dtype here, and the gathering casts in the same pass. Not asked of compressors with
        ``error_feedback``: residuals are kept in the gradients' dtype."""
        return None

    def residual(self, acc: torch.Tensor, payload: Payload) -> torch.Tensor:
        """What of ``acc`` the payload does not carry (before communication, as in GRACE's
        compensate -> compress -> update memory -> communicate); may reuse ``acc``."""
        raise NotImplementedError

    def settle(self, residual: torch.Tensor, payload: Payload, result: Any) -> None:
        """After communication: put back into ``residual`` what was sent but not applied."""

    def problem(self, request: Request) -> Optional[str]:
        """Why this compressor cannot serve the request's gradient dtypes or ranks."""
        return None

    def for_optimizer(self) -> "Compressor":
        """The instance one optimizer uses: itself, or a copy with state of its own where the
        compressor keeps state between steps (so that optimizers never share it)."""
        return self

    def state_dict(self) -> Optional[dict]:
        """State the compressor keeps between steps, for the checkpoint (None: none)."""
        return None

    def load_state_dict(self, state: dict) -> None:
        raise HvcommError(f"the checkpoint holds compressor state, but {self!r} keeps none: "
                          "load it into an optimizer with the compression it was saved with")

    # Horovod's interface: for compressors whose payload a dense allreduce can sum
    def compress(self, tensor: torch.Tensor, step: int = 0, key: str = ""):
        self._check_horovod_interface()
        payload = self.encode(tensor, step, key)
        return payload.data, payload

    def decompress(self, data: Any, ctx: Payload) -> torch.Tensor:
        self._check_horovod_interface()
        return self.decode(data, ctx)

    def _check_horovod_interface(self) -> None:
        if not isinstance(self.collective, Allreduce):
            raise HvcommError(f"{self!r} needs its own collective ({self.collective.label}): "
                              "use it as DistributedOptimizer(compression=...), not in "
                              "compress()/decompress() or hvd.allreduce(compression=...)")


def is_native(compressor: Any) -> bool:
    """An hvcomm compressor (its own ``encode``), not one with Horovod's interface alone (an
    object with ``compress``/``decompress``, a subclass of ``Compressor`` included)."""
    return isinstance(compressor, Compressor) and type(compressor).encode is not Compressor.encode


def sends_as_is(compression: Any) -> bool:
    """The gradients travel as they are (``Compression.none``)."""
    return getattr(compression, "sends_as_is", False)


def check_density(density: float) -> float:
    """``density`` as a float, or an HvcommError unless it is a number in (0, 1]."""
    if isinstance(density, bool) or not isinstance(density, (int, float)) \
            or not 0 < density <= 1:
        raise HvcommError(f"density must be in (0, 1], got {density!r}")
    return float(density)


def check_scope(scope: str) -> str:
    if scope not in ("layer", "model", "bucket"):
        raise HvcommError(f"scope must be 'layer', 'model' or 'bucket', got {scope!r}")
    return scope


def float_problem(dtypes, name: str) -> Optional[str]:
    bad = sorted({str(d) for d in dtypes} - {"torch.float32", "torch.float64"})
    if bad:
        return (f"{name} needs float32 or float64 gradients, got {bad}; for 16-bit "
                "gradients use Compression.none or Compression.fp16 (bfloat16 travels as it is)")
    return None


def zero_at(acc: torch.Tensor, indices) -> torch.Tensor:
    """``acc`` with the sent positions zeroed (the residual of a selection)."""
    if isinstance(indices, np.ndarray):
        indices = torch.from_numpy(indices.astype(np.int64))
    acc.view(-1)[indices] = 0
    return acc
