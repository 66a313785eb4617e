"""Profile a model of your own for the simulator and the advisor: each layer's forward and
backward time over a few training steps on this machine (its GPU if torch sees one, else its
CPU), as a trace in the layout of hvcomm/sim/traces that ``python -m hvcomm.advise --trace``
reads.

From Python::

    from hvcomm.sim import profile
    trace = profile.measure(model, batch)     # a hvcomm.sim.simulate.LayerTrace
    trace.save("my_model.json")

From the advisor, ``--measure FILE.py:FACTORY`` imports FILE.py and calls FACTORY(), which
returns what :func:`measure` takes (:data:`CONTRACT`)::

    # my_model.py
    import torch, torchvision

    def make():
        return torchvision.models.resnet50(), torch.randn(64, 3, 224, 224)
"""
from __future__ import annotations

import contextlib
import importlib.util
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from collectives.errors import HvcommError
from hvcomm.torch.methods.schedule import Profiler

from .simulate import Layer, LayerTrace

CONTRACT = ("a function of no arguments that returns (model, batch) or (model, batch, loss_fn): "
            "model, a torch.nn.Module; batch, one worker's batch: a tensor (the model is called "
            "as model(batch)), a tuple or list of tensors (model(*batch)) or a dict of tensors "
            "(model(**batch)), its first tensor's first dimension the batch size; loss_fn "
            "(optional), the model's output to a scalar tensor (default: the output's sum, for a "
            "tensor output)")


def load_factory(spec: str) -> Tuple[Callable[[], Any], str]:
    """The function named by ``FILE.py:FACTORY``, and a name for its trace (``stem:FACTORY``).
    FILE.py is imported with its own folder on ``sys.path``."""
    path, sep, attr = spec.rpartition(":")
    if not sep or not path or not attr.isidentifier():
        raise HvcommError(f"--measure wants FILE.py:FACTORY (e.g. my_model.py:make), got {spec!r}")
    file = Path(path)
    module_spec = importlib.util.spec_from_file_location(f"_hvcomm_measured_{file.stem}", file)
    if not file.is_file() or module_spec is None:
        raise HvcommError(f"--measure {spec!r}: {path!r} is not a Python file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module  # as an import would (dataclasses look it up)
    folder = str(file.resolve().parent)
    sys.path.insert(0, folder)
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[module_spec.name]
        raise HvcommError(f"--measure {spec!r}: importing {path} raised "
                          f"{type(e).__name__}: {e}") from e
    finally:
        sys.path.remove(folder)
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise HvcommError(f"--measure {spec!r}: {path} defines no function {attr!r}; FACTORY "
                          f"must be {CONTRACT}")
    return factory, f"{file.stem}:{attr}"


def from_factory(spec: str, steps: int = 3, device: Optional[str] = None) -> LayerTrace:
    """:func:`measure` what the factory ``FILE.py:FACTORY`` returns (:data:`CONTRACT`)."""
    factory, name = load_factory(spec)
    try:
        made = factory()
    except Exception as e:
        raise HvcommError(f"--measure {spec!r}: {name}() raised {type(e).__name__}: {e}") from e
    if not isinstance(made, (tuple, list)) or len(made) not in (2, 3):
        raise HvcommError(f"--measure {spec!r}: {name}() returned {type(made).__name__}; FACTORY "
                          f"must be {CONTRACT}")
    return measure(*made, steps=steps, device=device, name=name)


def measure(model: torch.nn.Module, batch: Any, loss_fn: Optional[Callable] = None, *,
            steps: int = 3, device: Optional[str] = None,
            name: Optional[str] = None) -> LayerTrace:
    """Time ``model`` training on ``batch`` (one worker's, as :data:`CONTRACT` says): one
    untimed warm-up step, then the median of ``steps`` steps, on ``device`` (default: the
    model's GPU, else CUDA if torch sees a GPU, else the CPU).

    A layer is a module with trainable parameters of its own, in the order its forward ran.
    Its forward time runs from the previous layer's end to its own (what lies between layers
    goes to the layer after it, the loss to the last); its backward ends when its last
    gradient is final (hvcomm's gradient-ready profiler, the one MG-WFBP plans with) and
    starts where the backward so far had got to. Module backward hooks would fail on a model
    with an in-place operation after a layer (``ReLU(inplace=True)``). On a GPU every hook
    waits for the GPU first. The update: SGD with momentum. The model is left as it was: its
    device, mode, weights (the update runs at learning rate 0), buffers (BatchNorm's running
    statistics) and gradients."""
    if not isinstance(model, torch.nn.Module):
        raise HvcommError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise HvcommError(f"steps must be a whole number >= 1, got {steps!r}")
    args, kwargs = _call_arguments(batch)
    first = next((t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)), None)
    if first is None or first.dim() == 0:
        raise HvcommError(f"batch has no tensor with a batch dimension; it must be {CONTRACT}")
    home = next(model.parameters(), torch.empty(0)).device
    dev = torch.device(device) if device else home if home.type == "cuda" else \
        torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with _left_as_it_was(model, home):
        model.to(dev).train()
        layers, update_s, left_out = _layer_times(
            model, _to(args, dev), _to(kwargs, dev), loss_fn or _output_sum, steps, dev)
    on_gpu = dev.type == "cuda"
    trainable = [p for p in model.parameters() if p.requires_grad]
    source = (f"measured by hvcomm.sim.profile.measure: median of {steps} steps after one "
              f"untimed warm-up, batch {first.shape[0]}, torch {torch.__version__}; each "
              "layer's forward from forward hooks, its backward from its gradients' ready times; "
              "update: SGD with momentum")
    if left_out:
        source += f"; {left_out} parameters of modules that did not run are left out"
    return LayerTrace(name or type(model).__name__, tuple(layers), int(first.shape[0]),
                      update_s, max(p.element_size() for p in trainable), source,
                      "gpu" if on_gpu else "cpu", machine_of(dev))


def machine_of(dev: torch.device) -> str:
    """What a measurement on ``dev`` ran on, for a trace's ``measured_on``."""
    if dev.type == "cuda":
        return f"{torch.cuda.get_device_name(dev)} (CUDA, torch {torch.__version__})"
    return (f"{platform.machine()} CPU, {torch.get_num_threads()} threads (torch "
            f"{torch.__version__})")


def _call_arguments(batch: Any) -> Tuple[tuple, Dict[str, Any]]:
    if isinstance(batch, torch.Tensor):
        return (batch,), {}
    if isinstance(batch, (tuple, list)):
        return tuple(batch), {}
    if isinstance(batch, dict):
        return (), dict(batch)
    raise HvcommError(f"batch is a {type(batch).__name__}; it must be {CONTRACT}")


def _to(value: Any, dev: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dev)
    if isinstance(value, (tuple, list)):
        return type(value)(_to(v, dev) for v in value)
    if isinstance(value, dict):
        return {k: _to(v, dev) for k, v in value.items()}
    return value


def _output_sum(output: Any) -> torch.Tensor:
    if not isinstance(output, torch.Tensor) or not output.is_floating_point():
        raise HvcommError(f"the model returned a {type(output).__name__}, not a floating-point "
                          "tensor, so its sum is no loss: return (model, batch, loss_fn) from "
                          "the factory (or pass loss_fn), loss_fn turning the output into a "
                          "scalar tensor")
    return output.sum()


@contextlib.contextmanager
def _left_as_it_was(model: torch.nn.Module, home: torch.device):
    training = model.training
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    grads = {p: p.grad for p in model.parameters()}
    try:
        yield
    finally:
        model.to(home).train(training)
        with torch.no_grad():
            for n, b in model.named_buffers():
                b.copy_(buffers[n])
        for p, g in grads.items():
            p.grad = g


def _layer_times(model, args, kwargs, loss_fn, steps, dev) -> Tuple[List[Layer], float, int]:
    """The layers with their median times, the update's median time, and the number of
    parameters of modules whose forward did not run (left out)."""
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    owned: List[Tuple[str, torch.nn.Module, List[torch.nn.Parameter]]] = []
    owner: Dict[torch.nn.Parameter, int] = {}
    for mod_name, module in model.named_modules():
        mine = [p for p in module.parameters(recurse=False) if p.requires_grad and p not in owner]
        owner.update((p, len(owned)) for p in mine)
        if mine:
            owned.append((mod_name or "(model)", module, mine))  # "": the model's own
    if not owned:
        raise HvcommError(f"{type(model).__name__} has no trainable parameters: nothing to "
                          "synchronise")
    params = [p for _, _, mine in owned for p in mine]
    ends = np.zeros(len(owned))

    def forward_end(li):
        sync()
        ends[li] = time.perf_counter()

    def grad_ready(i):
        sync()
        profiler.grad_ready(i)

    # next_iteration() is called as each backward starts, so step s's backward is iteration
    # s + 1: skipping 2 leaves out the warm-up's
    profiler = Profiler(len(params), skip=2, steps=steps)
    hooks = [m.register_forward_hook(lambda *_a, li=li: forward_end(li))
             for li, (_, m, _) in enumerate(owned)]
    hooks += [p.register_post_accumulate_grad_hook(lambda _p, i=i: grad_ready(i))
              for i, p in enumerate(params)]
    opt = torch.optim.SGD(params, lr=0.0, momentum=0.9)
    order: List[int] = []
    forward, update = [], []
    try:
        for step in range(1 + steps):
            opt.zero_grad()
            sync()
            t0 = time.perf_counter()
            loss = _scalar(loss_fn(model(*args, **kwargs)))
            sync()
            profiler.next_iteration()  # backward starts now
            if not step:
                order = sorted(np.flatnonzero(ends > t0), key=ends.__getitem__)
            else:
                stamps = np.concatenate([[t0], ends[order]])
                forward.append(np.diff(stamps))
                forward[-1][-1] += profiler.start - stamps[-1]  # the loss
            loss.backward()
            sync()
            t1 = time.perf_counter()
            opt.step()
            sync()
            if step:
                update.append(time.perf_counter() - t1)
    except HvcommError:
        raise
    except Exception as e:
        raise HvcommError(f"a training step of {type(model).__name__} on {dev} raised "
                          f"{type(e).__name__}: {e}") from e
    finally:
        for h in hooks:
            h.remove()
    forward_s = np.median(np.array(forward), axis=0)
    ready = [float(np.median(t)) if t else None for t in profiler.ready]
    index = {p: i for i, p in enumerate(params)}
    backward_s, reached = [0.0] * len(order), 0.0
    for j in reversed(range(len(order))):
        times = [ready[index[p]] for p in owned[order[j]][2] if ready[index[p]] is not None]
        done = max(times, default=reached)
        backward_s[j], reached = max(done - reached, 0.0), max(reached, done)
    layers = [Layer(owned[li][0], sum(p.numel() for p in owned[li][2]), float(forward_s[j]),
                    backward_s[j], tuple(tuple(p.shape) for p in owned[li][2]))
              for j, li in enumerate(order)]
    left_out = sum(p.numel() for li in set(range(len(owned))) - set(order) for p in owned[li][2])
    return layers, float(np.median(update)), left_out


def _scalar(loss: Any) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
        raise HvcommError(f"the loss must be a scalar tensor that requires grad, got "
                          f"{type(loss).__name__}"
                          f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
    return loss
