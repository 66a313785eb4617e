"""Replay a traced model: each layer's computation becomes a timed wait, the gradients are real.

A :class:`ReplayModel` has the trace's parameter tensors (their real shapes) and, per layer, an
autograd function that sleeps the layer's forward time in forward and its backward time in
backward, then hands back a fixed gradient (seeded per rank and layer). Sleeping uses no CPU,
as a GPU kernel leaves the CPU free, so hvcomm's real DistributedOptimizer (every compression,
schedule and delay mode) communicates over the real network while "computation" runs, and the
iteration time is what a GPU cluster with these layer times and this network would see, less
the gradient copies this machine makes (one memcpy of the model per step).
"""
from __future__ import annotations

import time
from typing import List

import torch
from torch import nn

from .simulate import LayerTrace


class _Clock:
    """Waits that keep their sum exact: a layer of 50 us cannot sleep 50 us (the OS wakes
    the thread ~60 us late), so each wait sleeps until a deadline that advances by the
    layer's time from where the pass started, and a late wake-up is paid back by the next."""

    def __init__(self):
        self.deadline = 0.0

    def start(self) -> None:
        self.deadline = time.perf_counter()

    def wait(self, seconds: float) -> None:
        self.deadline = max(self.deadline, time.perf_counter() - 1e-3) + seconds
        remaining = self.deadline - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)


class _Timed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, layer, *params):
        ctx.layer = layer
        layer.clock.wait(layer.forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        layer = ctx.layer
        if layer.first_in_backward:
            layer.clock.start()
        layer.clock.wait(layer.backward_s)
        return (grad, None, *layer.gradients)


class _ReplayLayer(nn.Module):
    def __init__(self, layer, rank: int, index: int, clock: _Clock):
        super().__init__()
        self.clock, self.first_in_backward = clock, False
        shapes = layer.shapes or ((layer.params,),)
        gen = torch.Generator().manual_seed(1000 * rank + index)
        # the layer owns its parameters itself, so that its forward pre-hooks see them (P3
        # with model= applies each layer's update just before the layer's next forward)
        self.weights = []
        for j, s in enumerate(shapes):
            self.register_parameter(f"w{j}", nn.Parameter(torch.zeros(s)))
            self.weights.append(getattr(self, f"w{j}"))
        self.gradients: List[torch.Tensor] = [torch.randn(s, generator=gen) * 1e-3
                                              for s in shapes]
        self.forward_s, self.backward_s = layer.forward_s, layer.backward_s

    def forward(self, x):
        return _Timed.apply(x, self, *self.weights)


class ReplayModel(nn.Module):
    """The trace's layers in forward order; ``model()`` runs one timed forward pass and returns
    a one-element tensor whose ``backward()`` is the timed backward pass."""

    def __init__(self, trace: LayerTrace, rank: int = 0):
        super().__init__()
        self.trace = trace
        self.clock = _Clock()
        self.layers = nn.ModuleList([_ReplayLayer(layer, rank, i, self.clock)
                                     for i, layer in enumerate(trace.layers) if layer.params])
        self.layers[-1].first_in_backward = True
        # layers without parameters still take their time (forward and backward)
        self._idle_forward_s = sum(layer.forward_s for layer in trace.layers if not layer.params)
        self.layers[-1].backward_s += sum(layer.backward_s for layer in trace.layers
                                          if not layer.params)

    def forward(self):
        x = torch.zeros(1)
        self.clock.start()
        self.clock.wait(self._idle_forward_s)
        for layer in self.layers:
            x = layer(x)
        return x.sum()
