"""The main job's workloads (scripts/workloads.py): the data each one generates or reads, the
held-out split of the transformer's text, causality, each metric against a direct
computation, and the CNN's learning rate schedule; scripts/train.py's refusals, and its methods
trained in turn in one process."""
import math
import sys
import sysconfig
import zlib
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import workloads  # noqa: E402


def test_the_held_out_text_comes_from_other_files():
    root = Path(sysconfig.get_paths()["stdlib"])
    train = workloads.stdlib_text(False, 1 << 16)
    test = workloads.stdlib_text(True, 1 << 16)
    assert len(train) == len(test) == 1 << 16
    files = [(p, zlib.crc32(str(p.relative_to(root)).encode()) % 10 == 0)
             for p in sorted(root.rglob("*.py")) if "site-packages" not in str(p)]
    first_held = next(p.read_bytes() for p, held in files if held and p.stat().st_size > 1000)
    first_kept = next(p.read_bytes() for p, held in files if not held and p.stat().st_size > 0)
    assert first_held[:1000] in test and first_held[:1000] not in train
    assert train.startswith(first_kept[:1000])


def test_the_transformer_predicts_the_next_byte_and_is_causal():
    w = workloads.WORKLOADS["transformer"]
    (x, y), _ = w.load(0)
    text = workloads.stdlib_text(False, workloads.TRAIN_BYTES)
    n = workloads.CONTEXT
    assert x.shape[1] == y.shape[1] == n and x.dtype == torch.int64
    for i in (0, 1, len(x) - 1):
        assert bytes(x[i].tolist()) == text[i * n:(i + 1) * n]
        assert bytes(y[i].tolist()) == text[i * n + 1:(i + 1) * n + 1]
    model = w.model(0)
    assert not list(model.buffers())  # DDP would broadcast a buffer before every forward
    changed = x[:1].clone()
    changed[0, 64:] = (changed[0, 64:] + 1) % 256
    for mode in ("train", "eval"):
        getattr(model, mode)()
        with torch.no_grad():
            a, b = model(x[:1]), model(changed)
        assert torch.allclose(a[0, :64], b[0, :64], atol=1e-5), mode  # the past alone
        assert not torch.allclose(a[0, 64:], b[0, 64:], atol=1e-5), mode


def test_bits_per_character_is_the_cross_entropy_in_bits():
    w = workloads.WORKLOADS["transformer"]
    _, (xt, yt) = w.load(0)
    model = w.model(0).eval()
    xt, yt = xt[:100], yt[:100]  # two chunks of the evaluation's 64 windows, unequal
    with torch.no_grad():
        logits = model(xt)
        want = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), yt.reshape(-1))
    assert not w.higher_is_better
    assert w.evaluate(model, xt, yt) == pytest.approx(want.item() / math.log(2), rel=1e-5)


@pytest.mark.parametrize("name, n_train, n_test", [("digits", 1438, 359), ("cnn", 4000, 1000)])
def test_the_classifiers_data_and_accuracy(name, n_train, n_test):
    w = workloads.WORKLOADS[name]
    (x, y), (xt, yt) = w.load(0)
    assert len(x) == len(y) == n_train and len(xt) == len(yt) == n_test
    assert set(y.tolist()) == set(yt.tolist()) == set(range(10))
    model = w.model(0).eval()
    with torch.no_grad():
        predicted = model(xt).argmax(1).tolist()
    want = sum(p == t for p, t in zip(predicted, yt.tolist())) / n_test
    assert w.higher_is_better and w.evaluate(model, xt, yt) == pytest.approx(want)


def test_the_cnns_learning_rate_follows_a_cosine_and_the_others_stay_constant():
    cnn, digits = workloads.WORKLOADS["cnn"], workloads.WORKLOADS["digits"]
    # cos(0) = 1, cos(pi/2) = 0, cos(pi/3) = 1/2, cos(pi) = -1: lr, lr/2, 3lr/4, 0
    assert [cnn.lr_at(0.2, e, 6) for e in (0, 3, 2)] == pytest.approx([0.2, 0.1, 0.15])
    assert cnn.lr_at(0.2, 6, 6) == pytest.approx(0.0, abs=1e-12)
    assert [digits.lr_at(0.2, e, 6) for e in range(6)] == [0.2] * 6


TRAIN = Path(__file__).resolve().parent.parent / "scripts" / "train.py"


@pytest.mark.parametrize("args, says", [
    (["--workload", "cnn", "--method", "od-sgd"], "cosine schedule would leave undecayed"),
    (["--workload", "cnn", "--methods", "hvcomm-dense", "ssd-sgd"],
     "ssd-sgd step(s) locally at a fixed learning rate"),
    (["--methods", "hvcomm-dense", "ddp-dense"], "mixes frameworks (ddp, hvcomm)"),
    (["--methods", "hvcomm-dense", "--checkpoint-dir", "ckpt"], "give --method, not --methods"),
])
def test_train_refuses_what_it_cannot_run_before_training(args, says):
    import subprocess
    import os
    proc = subprocess.run([sys.executable, str(TRAIN), *args, "--epochs", "1"],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HVCOMM_CHECKPOINT_DIR": ""})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert says in proc.stderr


def test_methods_trained_in_turn_in_one_process_equal_each_trained_alone(tmp_path):
    """train.py --methods: the second method's metric per epoch and final weights are those of
    the same method run in a process of its own (the first leaves nothing behind)."""
    import json
    from hvcomm.cluster import launch
    common = ["--epochs", "2", "--delay-warmup", "10"]
    env = {"HVCOMM_TEST_EXPECT_SIZE": "2", "HVCOMM_CHECKPOINT_DIR": ""}
    runs = {}
    # od-sgd first: a delayed method, whose last allreduce is still in flight at its end
    for name, which in (("together", ["--methods", "od-sgd", "diloco-8"]),
                        ("alone", ["--method", "diloco-8"])):
        out = tmp_path / f"{name}.json"
        proc = launch.run(2, [str(TRAIN), *which, *common, "--out", str(out)], timeout=300,
                          env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = json.loads(out.read_text())
    first, second = runs["together"]
    alone = runs["alone"]
    assert [r["method"] for r in (first, second, alone)] == ["od-sgd", "diloco-8", "diloco-8"]
    assert second["ranks"] == alone["ranks"] == 2
    assert ([h["metric"] for h in second["history"]] == [h["metric"] for h in alone["history"]])
    assert second["final_weights_sha256"] == alone["final_weights_sha256"]
    assert first["final_weights_sha256"] != second["final_weights_sha256"]
