"""The main job's workloads (scripts/workloads.py): the data each one generates or reads, the
held-out split of the transformer's text, and the metric's direction."""
import math
import sys
import zlib
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import workloads  # noqa: E402


def test_the_held_out_text_comes_from_other_files():
    train = workloads.stdlib_text(False, 1 << 16)
    test = workloads.stdlib_text(True, 1 << 16)
    assert len(train) == len(test) == 1 << 16
    import sysconfig
    root = Path(sysconfig.get_paths()["stdlib"])
    held = [p for p in sorted(root.rglob("*.py"))
            if zlib.crc32(str(p.relative_to(root)).encode()) % 10 == 0]
    assert test.startswith(held[0].read_bytes()[:1000])
    assert held[0].read_bytes()[:1000] not in train


def test_the_transformer_predicts_the_next_byte():
    (x, y), (xt, yt) = workloads.WORKLOADS["transformer"].load(0)
    assert x.shape[1] == y.shape[1] == workloads.CONTEXT and x.dtype == torch.int64
    assert torch.equal(x[0, 1:], y[0, :-1]) and x[1, 0] == y[0, -1]
    assert len(x) == (workloads.TRAIN_BYTES - 1) // workloads.CONTEXT
    model = workloads.WORKLOADS["transformer"].model(0)
    out = model(x[:2])
    assert out.shape == (2, workloads.CONTEXT, 256)
    # causal: the first position's output does not depend on later inputs
    changed = x[:1].clone()
    changed[0, 1:] = (changed[0, 1:] + 1) % 256
    assert torch.allclose(model(changed)[0, 0], out[0, 0], atol=1e-6)
    assert not torch.allclose(model(changed)[0, -1], out[0, -1], atol=1e-6)


def test_an_untrained_model_scores_about_chance():
    w = workloads.WORKLOADS["transformer"]
    (_, _), (xt, yt) = w.load(0)
    bits = w.evaluate(w.model(0), xt[:16], yt[:16])
    assert not w.higher_is_better and abs(bits - 8) < 2.5, bits  # 256 symbols: 8 bits


@pytest.mark.parametrize("name, classes, n_train", [("digits", 10, 1438), ("cnn", 10, 4000)])
def test_the_classifiers_data_and_chance(name, classes, n_train):
    w = workloads.WORKLOADS[name]
    (x, y), (xt, yt) = w.load(0)
    assert len(x) == n_train and set(y.tolist()) == set(range(classes))
    acc = w.evaluate(w.model(0), xt, yt)
    assert w.higher_is_better and 0 <= acc < 0.5 and not math.isnan(acc)
