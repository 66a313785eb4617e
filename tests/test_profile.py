"""hvcomm.sim.profile: a model of the user's own measured layer by layer, from Python and from a
factory in a file, with clear errors for what does not fit the contract."""
import pytest
import torch
from torch import nn

from collectives.errors import HvcommError
from hvcomm.sim import profile


def small():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(inplace=True),
                         nn.Linear(16, 4))


def test_measure_times_each_layer_and_leaves_the_model_as_it_was():
    model = small().eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trace = profile.measure(model, torch.randn(6, 8), steps=2)
    assert [layer.name for layer in trace.layers] == ["0", "1", "3"]
    assert trace.params == sum(p.numel() for p in model.parameters())
    assert all(layer.forward_s > 0 and layer.backward_s > 0 for layer in trace.layers)
    assert trace.batch == 6 and trace.update_s > 0 and trace.measured_on
    assert "median of 2 steps after one untimed warm-up" in trace.source
    # weights, BatchNorm's running statistics, mode and gradients as they were
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not model.training and all(p.grad is None for p in model.parameters())


def test_a_dict_batch_and_a_loss_of_ones_own():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 5), nn.Linear(3, 5)

        def forward(self, x, y):
            return {"out": self.a(x) + self.b(y)}

    trace = profile.measure(Net(), {"x": torch.randn(4, 3), "y": torch.randn(4, 3)},
                            lambda out: out["out"].pow(2).mean(), steps=1, name="net")
    assert [layer.name for layer in trace.layers] == ["a", "b"] and trace.model == "net"


def write(tmp_path, body):
    path = tmp_path / "factory.py"
    path.write_text("import torch\nfrom torch import nn\n" + body)
    return path


@pytest.mark.parametrize("body, spec, message", [
    ("def make():\n    return nn.Linear(2, 2)\n", "make", "returned Linear"),
    ("def make():\n    return 1, 2\n", "make", "model must be a torch.nn.Module, got int"),
    ("def make():\n    return nn.Linear(2, 2), [1, 2]\n", "make", "batch has no tensor"),
    ("def make():\n    return nn.Linear(2, 2), torch.randn(3, 2), lambda out: out\n", "make",
     "the loss must be a scalar tensor"),
    ("def make():\n    return nn.LSTM(2, 2), torch.randn(3, 1, 2)\n", "make",
     "the model returned a tuple, not a floating-point tensor"),
    ("def make():\n    return nn.Linear(2, 2), torch.randn(3, 5)\n", "make",
     "a training step of Linear on cpu raised RuntimeError"),
    ("def make():\n    raise ValueError('no data here')\n", "make",
     "make() raised ValueError: no data here"),
    ("raise ImportError('needs timm')\n", "make", "raised ImportError: needs timm"),
    ("def build():\n    pass\n", "make", "defines no function 'make'"),
])
def test_bad_factories_are_refused_with_the_contract(tmp_path, body, spec, message):
    path = write(tmp_path, body)
    with pytest.raises(HvcommError) as e:
        profile.from_factory(f"{path}:{spec}", steps=1, device="cpu")
    assert message in str(e.value), e.value
