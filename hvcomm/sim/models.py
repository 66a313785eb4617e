"""The models whose traces the simulator and the replay use, built here from torch layers (no
downloads): ResNet-20 (CIFAR-10, :func:`cifar_resnet`), ResNet-50 and VGG-16 (ImageNet),
BERT-base (sequence 128); :func:`layer_profile`, each parameterised module's parameters and
forward FLOPs per sample; :func:`measured_profile`, their forward and backward times measured
on this machine (by :mod:`hvcomm.sim.profile`).
"""
from __future__ import annotations

from typing import Dict, List

import torch
from torch import nn


def _projection(cin, cout, stride):
    """A residual block's shortcut: a 1x1 convolution where the shape changes, else identity."""
    if stride == 1 and cin == cout:
        return nn.Identity()
    return nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))


class _Basic(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = _projection(cin, cout, stride)

    def forward(self, x):
        y = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))
        return torch.relu(y + self.short(x))


class _Bottleneck(nn.Module):
    def __init__(self, cin, width, stride):
        super().__init__()
        cout = width * 4
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.short = _projection(cin, cout, stride)

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = torch.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return torch.relu(y + self.short(x))


def cifar_resnet(depth: int = 20) -> nn.Module:
    """CIFAR-10 ResNet-(6n+2): 16/32/64 channels, n basic blocks per stage."""
    if (depth - 2) % 6:
        raise ValueError(f"a CIFAR ResNet has depth 6n+2 (20, 32, 44, 56), got {depth}")
    layers: List[nn.Module] = [nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU()]
    cin = 16
    for cout, stride in ((16, 1), (32, 2), (64, 2)):
        for b in range((depth - 2) // 6):
            layers.append(_Basic(cin, cout, stride if b == 0 else 1))
            cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10)]
    return nn.Sequential(*layers)


def resnet50() -> nn.Module:
    layers: List[nn.Module] = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64),
                               nn.ReLU(), nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for b in range(blocks):
            layers.append(_Bottleneck(cin, width, stride if b == 0 else 1))
            cin = width * 4
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2048, 1000)]
    return nn.Sequential(*layers)


def vgg16() -> nn.Module:
    layers: List[nn.Module] = []
    cin = 3
    for v in (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M",
              512, 512, 512, "M"):
        if v == "M":
            layers.append(nn.MaxPool2d(2))
        else:
            layers += [nn.Conv2d(cin, v, 3, 1, 1), nn.ReLU()]
            cin = v
    layers += [nn.Flatten(), nn.Linear(512 * 7 * 7, 4096), nn.ReLU(), nn.Linear(4096, 4096),
               nn.ReLU(), nn.Linear(4096, 1000)]
    return nn.Sequential(*layers)


class _Attention(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        att = torch.softmax(q @ k.transpose(-1, -2) / (h // self.heads) ** 0.5, dim=-1)
        return self.out((att @ v).transpose(1, 2).reshape(b, s, h))


class _EncoderLayer(nn.Module):
    def __init__(self, hidden, heads, inner):
        super().__init__()
        self.attention = _Attention(hidden, heads)
        self.norm1 = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, inner)
        self.down = nn.Linear(inner, hidden)
        self.norm2 = nn.LayerNorm(hidden)

    def forward(self, x):
        x = self.norm1(x + self.attention(x))
        return self.norm2(x + self.down(torch.nn.functional.gelu(self.up(x))))


class _Bert(nn.Module):
    def __init__(self, vocab=30522, hidden=768, layers=12, heads=12, inner=3072, positions=512):
        super().__init__()
        self.words = nn.Embedding(vocab, hidden)
        self.positions = nn.Embedding(positions, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.encoder = nn.Sequential(*[_EncoderLayer(hidden, heads, inner) for _ in range(layers)])
        self.pooler = nn.Linear(hidden, hidden)
        self.classifier = nn.Linear(hidden, 2)

    def forward(self, ids):
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.encoder(self.norm(self.words(ids) + self.positions(pos)))
        return self.classifier(torch.tanh(self.pooler(x[:, 0])))


def bert_base() -> nn.Module:
    return _Bert()


MODELS = {
    "resnet20": (cifar_resnet, lambda: torch.zeros(1, 3, 32, 32)),
    "resnet50": (resnet50, lambda: torch.zeros(1, 3, 224, 224)),
    "vgg16": (vgg16, lambda: torch.zeros(1, 3, 224, 224)),
    "bert-base": (bert_base, lambda: torch.zeros(1, 128, dtype=torch.long)),
}


def _flops(module: nn.Module, inputs, output) -> float:
    """Forward FLOPs of one call (multiply-adds count 2), for one sample (batch 1)."""
    if isinstance(module, nn.Conv2d):
        k = module.kernel_size[0] * module.kernel_size[1] * module.in_channels // module.groups
        return 2.0 * k * output.numel()
    if isinstance(module, nn.Linear):
        return 2.0 * module.in_features * output.numel()
    if isinstance(module, _Attention):  # the two matmuls of attention, beyond its linears
        b, s, h = inputs[0].shape
        return 2.0 * 2 * s * s * h
    if isinstance(module, (nn.BatchNorm2d, nn.LayerNorm)):
        return 4.0 * output.numel()
    return 0.0


def layer_profile(name: str) -> List[Dict]:
    """Each module that holds parameters of its own, in forward (call) order: its name,
    parameter shapes, parameter count and forward FLOPs per sample. Built on the meta device,
    so nothing is allocated or computed."""
    build, example = MODELS[name]
    with torch.device("meta"):
        model = build()
        x = example().to("meta")
    seen: Dict[str, Dict] = {}
    hooks = []
    for mod_name, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        if not own and not isinstance(module, _Attention):
            continue

        def hook(module, inputs, output, mod_name=mod_name, own=own):
            entry = seen.setdefault(mod_name, {
                "name": mod_name, "shapes": [list(p.shape) for p in own],
                "params": sum(p.numel() for p in own), "forward_flops": 0.0})
            entry["forward_flops"] += _flops(module, inputs, output)
        hooks.append(module.register_forward_hook(hook))
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    # attention's matmul FLOPs belong to its output projection's layer
    layers = []
    for entry in seen.values():
        if not entry["params"]:
            if layers:
                layers[-1]["forward_flops"] += entry["forward_flops"]
            continue
        layers.append(entry)
    return layers


def measured_profile(name: str, batch: int, steps: int = 5, seed: int = 0) -> Dict:
    """Each parameter-holding module's forward and backward time on this machine's CPU
    (float32, the threads torch has), in forward (call) order: the median over ``steps``
    training steps after one warm-up, with a cross-entropy loss, and the SGD-with-momentum
    update's time (:func:`hvcomm.sim.profile.measure` says how). Returns {"layers": [{"name",
    "shapes", "params", "forward_s", "backward_s"}], "update_s"}."""
    from .profile import measure

    build, example = MODELS[name]
    torch.manual_seed(seed)
    model = build()
    one = example()
    shape = (batch, *one.shape[1:])
    x = torch.randint(0, 1000, shape) if one.dtype == torch.long else torch.randn(shape)
    target = torch.zeros(batch, dtype=torch.long)
    trace = measure(model, x, lambda out: torch.nn.functional.cross_entropy(out, target),
                    steps=steps, device="cpu", name=name).to_dict()
    return {"layers": trace["layers"], "update_s": trace["update_s"]}
