"""The main job's workloads: each one's data (needing no download), model, loss and metric.

- ``digits``: scikit-learn's 8x8 digits (1438 train / 359 test), an MLP 64-512-512-10; test
  accuracy.
- ``cnn``: MNIST-1D (the ``mnist1d`` package generates it: 4,000 train / 1,000 test sequences
  of length 40; its authors report about 68% for an MLP and 94% for a CNN), a small 1-D CNN;
  test accuracy.
- ``transformer``: a character-level (byte-level) language model on the Python standard
  library's own source, 4 layers, width 128, context 128; files are split by a hash of their
  name (one in ten held out), so validation text comes from files never trained on; bits per
  character on the held-out windows (lower is better). Four epochs of 128 KiB (31 steps of 8
  windows per rank per epoch at 4 ranks): what fits the main job's time here, far from
  converged. Which files are read depends on the Python build (here CPython 3.11.7).

Each workload gives ``(train inputs, train targets), (test inputs, test targets)`` as tensors
whose first dimension counts the samples, a model from a seed, and its metric.
"""
from __future__ import annotations

import math
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Tuple

import torch

Data = Tuple[Tuple[torch.Tensor, torch.Tensor], Tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Workload:
    """``load(seed)``: the data; ``model(seed)``; ``metric``: its name, and whether higher is
    better; ``evaluate(model, x, y)``: the metric on the test set; ``lr``, ``epochs``, ``batch``
    (per rank) and ``warmup_steps`` (the delayed and periodic methods' synchronous steps): the
    job's defaults (SGD with momentum 0.9, or AdamW with ``adam``); ``cosine``: the learning
    rate annealed to 0 by a cosine over the epochs (:meth:`lr_at`)."""

    name: str
    load: Callable[[int], Data]
    model: Callable[[int], torch.nn.Module]
    metric: str
    higher_is_better: bool
    lr: float
    epochs: int
    batch: int = 8
    warmup_steps: int = 100
    adam: bool = False
    cosine: bool = False

    def lr_at(self, lr: float, epoch: int, epochs: int) -> float:
        """The learning rate of (0-based) ``epoch`` of ``epochs`` for a job's ``lr``."""
        return lr * (1 + math.cos(math.pi * epoch / epochs)) / 2 if self.cosine else lr

    def loss(self, model, x, y) -> torch.Tensor:
        out = model(x)
        return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    def evaluate(self, model, x, y) -> float:
        with torch.no_grad():
            if self.higher_is_better:  # accuracy
                return (model(x).argmax(-1) == y).float().mean().item()
            total = sum(self.loss(model, x[i:i + 64], y[i:i + 64]).item() * len(x[i:i + 64])
                        for i in range(0, len(x), 64))
            return total / len(x) / math.log(2)  # bits per character


# -- digits ------------------------------------------------------------------------------------
HIDDEN = 512


def _digits(seed: int) -> Data:
    from sklearn.datasets import load_digits
    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target, dtype=torch.int64)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_test = len(x) // 5
    return (x[perm[n_test:]], y[perm[n_test:]]), (x[perm[:n_test]], y[perm[:n_test]])


def _mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, HIDDEN), torch.nn.ReLU(),
                               torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(),
                               torch.nn.Linear(HIDDEN, 10))


# -- MNIST-1D ----------------------------------------------------------------------------------
def _mnist1d(seed: int) -> Data:
    """Generated, never downloaded (``make_dataset``, not ``get_dataset``); the split is the
    package's own, from its default seed (it reseeds Python's and NumPy's global generators);
    ``seed`` is unused (the same data every run)."""
    from mnist1d.data import get_dataset_args, make_dataset
    data = make_dataset(get_dataset_args())
    as_x = lambda a: torch.tensor(a, dtype=torch.float32).unsqueeze(1)  # noqa: E731
    as_y = lambda a: torch.tensor(a, dtype=torch.int64)  # noqa: E731
    return (as_x(data["x"]), as_y(data["y"])), (as_x(data["x_test"]), as_y(data["y_test"]))


def _cnn(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv1d(1, 32, 5, padding=2), torch.nn.ReLU(),
        torch.nn.Conv1d(32, 32, 3, padding=1, stride=2), torch.nn.ReLU(),
        torch.nn.Conv1d(32, 32, 3, padding=1, stride=2), torch.nn.ReLU(),
        torch.nn.Flatten(), torch.nn.Linear(32 * 10, 10))


# -- the standard library's source ---------------------------------------------------------------
CONTEXT, WIDTH, LAYERS, HEADS = 128, 128, 4, 4
TRAIN_BYTES, TEST_BYTES = 1 << 17, 1 << 16  # 128 KiB of training text, 64 KiB held out


def stdlib_text(held_out: bool, limit: int) -> bytes:
    """The first ``limit`` bytes of the standard library's .py files, sorted by path, taking
    those whose path's crc32 is a multiple of 10 (``held_out``) or the others."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out, size = [], 0
    for path in sorted(root.rglob("*.py")):
        rel = str(path.relative_to(root))
        if "site-packages" in rel or (zlib.crc32(rel.encode()) % 10 == 0) != held_out:
            continue
        text = path.read_bytes()
        out.append(text)
        size += len(text)
        if size >= limit:
            break
    return b"".join(out)[:limit]


def _windows(text: bytes) -> Tuple[torch.Tensor, torch.Tensor]:
    """Consecutive windows of CONTEXT + 1 bytes: inputs and next-byte targets."""
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).to(torch.int64)
    n = (len(data) - 1) // CONTEXT
    x = data[:n * CONTEXT].reshape(n, CONTEXT)
    y = data[1:n * CONTEXT + 1].reshape(n, CONTEXT)
    return x, y


def _stdlib(seed: int) -> Data:
    return _windows(stdlib_text(False, TRAIN_BYTES)), _windows(stdlib_text(True, TEST_BYTES))


class CharTransformer(torch.nn.Module):
    """A decoder-only transformer over bytes: learned positions, pre-norm blocks of causal
    self-attention and a 4x MLP, the output tied to no input."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(256, WIDTH)
        self.position = torch.nn.Parameter(torch.zeros(CONTEXT, WIDTH))
        layer = torch.nn.TransformerEncoderLayer(WIDTH, HEADS, 4 * WIDTH, dropout=0.0,
                                                 batch_first=True, norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.head = torch.nn.Linear(WIDTH, 256)
        # not a buffer: DDP would broadcast it from rank 0 before every forward
        self.causal = torch.nn.Transformer.generate_square_subsequent_mask(CONTEXT)

    def forward(self, x):
        t = x.shape[1]
        h = self.embed(x) + self.position[:t]
        h = self.blocks(h, mask=self.causal[:t, :t], is_causal=True)
        return self.head(self.norm(h))


def _transformer(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return CharTransformer()


WORKLOADS = {w.name: w for w in (
    Workload("digits", _digits, _mlp, "test acc", True, lr=0.05, epochs=15),
    # batch 32 and the cosine: at batch 8 (lr 0.02 or 0.05) and without annealing the test
    # accuracy swung by 1-2 points from one epoch to the next, as much as the methods differ
    Workload("cnn", _mnist1d, _cnn, "test acc", True, lr=0.1, epochs=30, batch=32,
             cosine=True),
    Workload("transformer", _stdlib, _transformer, "bits per char", False, lr=1e-3, epochs=4,
             warmup_steps=20, adam=True),
)}
