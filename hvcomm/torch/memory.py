"""Error-feedback memory: the residual of each bucket, kept apart from the compressors."""
from __future__ import annotations

from typing import Dict

import torch


class ErrorFeedback:
    """Residuals by bucket key. ``compensate`` adds the residual to a new gradient;
    ``store`` keeps what was not sent. Saved and restored with the optimizer's state_dict."""

    def __init__(self):
        self.residuals: Dict[str, torch.Tensor] = {}

    def compensate(self, key: str, grad: torch.Tensor) -> torch.Tensor:
        """grad + residual (grad is the optimizer's own flat copy: updated in place)."""
        res = self.residuals.get(key)
        return grad.add_(res) if res is not None else grad

    def store(self, key: str, residual: torch.Tensor) -> None:
        self.residuals[key] = residual

    def state_dict(self) -> Dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.residuals.items()}

    def load_state_dict(self, state: Dict[str, torch.Tensor]) -> None:
        self.residuals = {k: v.clone() for k, v in state.items()}
