"""Error-feedback memory: each parameter's residual, kept apart from the compressors and from
the grouping, so replanning the buckets and checkpoints lose nothing."""
from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import torch

from .buckets import split


class ErrorFeedback:
    """Residuals by parameter name. A bucket reads and writes them as one flat buffer
    (``kept``, ``store``, ``flat``); each parameter's residual is a view into the
    buffer its bucket last stored, so the usual step copies nothing."""

    def __init__(self):
        self._by_name: Dict[str, torch.Tensor] = {}
        self._flats: Dict[Tuple[str, ...], torch.Tensor] = {}  # bucket -> the buffer it stored
        self._owner: Dict[str, Tuple[str, ...]] = {}            # parameter -> that bucket

    def kept(self, names: Sequence[str], numels: Sequence[int],
             dtype: torch.dtype) -> Optional[torch.Tensor]:
        """The bucket's flat residual, to be added to its next gradient; None where none of
        its parameters has one."""
        if any(n in self._by_name for n in names):
            return self.flat(names, numels, dtype)
        return None

    def store(self, names: Sequence[str], numels: Sequence[int], residual: torch.Tensor) -> None:
        """Keep ``residual`` (the flat residual of a bucket of these parameters)."""
        key = tuple(names)
        for i, part in split(residual, numels):
            old = self._owner.get(names[i])
            if old is not None and old != key:
                self._flats.pop(old, None)
            self._owner[names[i]] = key
            self._by_name[names[i]] = part
        self._flats[key] = residual

    def flat(self, names: Sequence[str], numels: Sequence[int],
             dtype: torch.dtype) -> torch.Tensor:
        """The bucket's residual as one flat buffer (zeros where none was kept), stored so
        that writes into it are the parameters' residuals."""
        key = tuple(names)
        if key not in self._flats:
            self.store(names, numels, torch.cat([
                self._by_name[n].reshape(-1) if n in self._by_name else torch.zeros(m, dtype=dtype)
                for n, m in zip(names, numels)]))
        return self._flats[key]

    def state_dict(self) -> Dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self._by_name.items()}

    def load_state_dict(self, state: Dict[str, torch.Tensor]) -> None:
        self._by_name = {k: v.clone().reshape(-1) for k, v in state.items()}
        self._flats, self._owner = {}, {}
