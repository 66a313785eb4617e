"""The method registry: one name per method, an unknown name refused with the valid ones, every
method trainable from the options it declares, and dispatch code that names no method."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from collectives.errors import HvcommError
from hvcomm.torch import methods

ROOT = Path(__file__).resolve().parent.parent
DISPATCH = ["hvcomm/torch/optimizer.py", "hvcomm/torch/options.py", "hvcomm/torch/engine.py",
            "hvcomm/torch/methods/reducer.py", "hvcomm/sim/simulate.py"]


def test_each_module_declares_one_method_with_its_own_name():
    assert len(methods.REGISTRY) == len(methods.MODULES)
    for module in methods.MODULES:
        declared = __import__(f"hvcomm.torch.methods.{module}", fromlist=["METHOD"]).METHOD
        assert methods.REGISTRY[declared.name] is declared
        assert declared.name.replace("-", "_") == module, (module, declared.name)
        assert declared.role in ("compression", "schedule", "delay"), declared


def test_unknown_names_list_the_valid_ones():
    with pytest.raises(HvcommError) as e:
        methods.get("fastest")
    assert all(repr(n) in str(e.value) for n in methods.names())
    with pytest.raises(HvcommError, match="unknown schedule method 'gtopk'"):
        methods.get("gtopk", "schedule")


def test_the_delay_modes_old_names_are_refused_with_the_valid_ones():
    from hvcomm.torch.methods.request import Request
    from hvcomm.torch.methods.delayed import Delay
    for old in ("od", "ssd", "cd"):
        problem = Delay(old).problem(Request())
        assert problem and all(repr(n) in problem for n in methods.names("delay")), problem


def test_the_replay_times_whole_cycles_of_each_method():
    from hvcomm.torch.methods.case import Settings
    settings = Settings(delay_k=3, period=7)
    # the delayed methods reset or go full precision every k-th step, the periodic ones
    # average every period-th; every other method's steps are alike
    want = {"od-sgd": 3, "ssd-sgd": 3, "cd-sgd": 3, "local-sgd": 7, "diloco": 7}
    for name in methods.names():
        assert methods.get(name).cycle(settings) == want.get(name, 1), name


def test_compression_has_every_compression_method():
    for name in methods.names("compression"):
        assert getattr(methods.Compression, name) is methods.get(name).factory


@pytest.mark.parametrize("path", DISPATCH)
def test_dispatch_code_names_no_method(path):
    code = (ROOT / path).read_text()
    code = re.sub(r'"""[\s\S]*?"""', "", code)            # docstrings may say what is meant
    code = "\n".join(line.split("#")[0] for line in code.splitlines())
    named = [n for n in methods.names() if re.search(rf"""["']{re.escape(n)}["']""", code)]
    assert not named, f"{path} names {named}"


TRAIN = """
import math, sys, torch
import hvcomm.torch as hvd
from hvcomm.torch import methods
from hvcomm.torch.methods.case import Settings
hvd.init()
for name in methods.names():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    settings = Settings(density=0.1, warmup_steps=1, trial_steps=1)
    options = methods.get(name).optimizer_options(settings, model)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(), **options)
    x, y = torch.randn(32, 6), torch.randn(32, 2)
    losses = []
    for _ in range(12):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    opt.finish_pending()
    assert all(math.isfinite(v) for v in losses), (name, losses)
    print(name, round(losses[0], 4), round(losses[-1], 4))
print("trained", len(methods.names()))
"""


def test_every_method_trains_from_the_options_it_declares():
    """One rank, each method's own DistributedOptimizer options (as the replay uses them)."""
    proc = subprocess.run([sys.executable, "-c", TRAIN], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"trained {len(methods.names())}" in proc.stdout, proc.stdout
