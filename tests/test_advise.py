"""The advisor's command line (hvcomm.sim.advise, in this process): clusters of nodes and GPUs,
the defaults it assumes and says, a model of the user's own measured with --measure, and
clear refusals."""
import json

import pytest

from hvcomm.sim import advise
from hvcomm.sim import simulate as S

TINY = '''
import torch
from torch import nn


def make():
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(inplace=True),
                          nn.Linear(16, 4))
    return model, torch.randn(6, 8)
'''


def run(capsys, *argv):
    code = advise.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def rows(out):
    """The table's rows: method -> iteration ms."""
    return {line.split("|")[1].strip(): float(line.split("|")[2]) for line in out.splitlines()
            if line.startswith("| ") and "method" not in line}


def test_nodes_and_gpus_per_node(capsys):
    code, out, err = run(capsys, "--model", "resnet50", "--nodes", "2", "--gpus-per-node", "4",
                         "--intra", "pcie4", "--net", "1gbit")
    assert code == 0, err
    assert "2 nodes x 4 GPUs (8 workers): pcie4 inside a node, 1gbit between nodes" in out
    assert "Not given, so assumed: --gpu v100." in out
    times = rows(out)
    assert set(times) == set(S.METHODS) and list(times.values()) == sorted(times.values())
    assert "- assumed: the link inside a node, pcie4: 252.1 Gbit/s each way" in out


def test_model_alone_assumes_a_gpu_and_a_cluster_and_says_so(capsys):
    code, out, err = run(capsys, "--model", "resnet50")
    assert code == 0, err
    assert (f"Not given, so assumed: --gpu {S.DEFAULT_GPU}, --net 10gbit, --nodes 4, "
            "--gpus-per-node 8, --intra nvlink2.") in out
    assert "4 nodes x 8 GPUs (32 workers)" in out and {"fp16", "powersgd"} <= set(rows(out))
    assert "- assumed: each layer's forward and backward time: estimated for NVIDIA V100" in out
    assert "- assumed: the network between nodes, 10gbit" in out


def test_workers_are_hosts_of_one_gpu(capsys):
    code, out, err = run(capsys, "--model", "vgg16", "--gpu", "a100", "--workers", "200")
    assert code == 0, err
    assert "200 workers (one GPU per node) on 10gbit" in out and "link inside" not in out
    assert "No row for twobit: " in out and "at most 127 ranks, got 200" in out


@pytest.mark.parametrize("argv, message", [
    ([], "give one of --model NAME (with --gpu), --trace FILE or --measure FILE.py:FACTORY"),
    (["--model", "resnet50", "--workers", "8", "--nodes", "2"], "not both"),
    (["--model", "resnet50", "--workers", "8", "--intra", "nvlink2"], "not both"),
    (["--model", "resnet50", "--gpus-per-node", "1", "--intra", "nvlink2"],
     "with one GPU per node there is none"),
    (["--model", "resnet50", "--nodes", "0"], "nodes must be a whole number >= 1, got 0"),
    (["--model", "resnet50", "--intra", "nvlink9"], "unknown intra-node link 'nvlink9'"),
    (["--model", "resnet50", "--net", "2gbit"], "unknown network '2gbit'"),
    (["--model", "resnet50", "--gpu", "h900"], "available in hvcomm/sim/traces"),
    (["--trace", "resnet50-v100", "--gpu", "v100"], "--gpu picks the shipped trace of --model"),
    (["--model", "resnet50", "--measure", "m.py:make"], "not --model and --measure"),
    (["--measure", "m.py"], "--measure wants FILE.py:FACTORY"),
    (["--measure", "/no/such/m.py:make"], "'/no/such/m.py' is not a Python file"),
])
def test_bad_input_is_refused_with_what_to_do(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2 and message in err, err


def test_measure_a_model_of_your_own(tmp_path, monkeypatch, capsys):
    (tmp_path / "tiny.py").write_text(TINY)
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, "--measure", "tiny.py:make", "--nodes", "2",
                         "--gpus-per-node", "2", "--steps", "1")
    assert code == 0, err
    written = list(tmp_path.glob("tiny-make-*.json"))
    assert len(written) == 1 and f"trace written to {written[0].name}" in out
    trace = json.loads(written[0].read_text())
    # the layers of the factory's model: modules with parameters of their own, in order
    assert [(layer["name"], layer["params"], layer["shapes"]) for layer in trace["layers"]] == [
        ("0", 8 * 16 + 16, [[16, 8], [16]]), ("1", 16 + 16, [[16], [16]]),
        ("3", 16 * 4 + 4, [[4, 16], [4]])]
    assert all(layer["forward_s"] > 0 and layer["backward_s"] > 0
               for layer in trace["layers"]), trace
    assert trace["update_s"] > 0 and trace["batch"] == 6 and trace["measured_on"]
    assert trace["model"] == "tiny:make" and trace["device"] in ("cpu", "gpu")
    assert set(rows(out)) == set(S.METHODS)
    assert "2 nodes x 2 GPUs (4 workers)" in out
    assert "- measured: each layer's forward and backward time, on " in out
    # the written trace is what --trace reads
    code, again, err = run(capsys, "--trace", written[0].name, "--workers", "4")
    assert code == 0 and set(rows(again)) == set(S.METHODS), err
