"""Delayed synchronisation (OD-SGD, SSD-SGD, CD-SGD): warm-up equals S-SGD, global weights
agree on every rank every step, checkpoints resume exactly, the delay is real, bad input."""
import copy

import pytest
import torch

import hvcomm.torch as hvd

from harness import default_dtype, expect_everywhere
from training import (Net, assert_close, assert_same_everywhere, data, loss_fn, make_opt,
                      shard, train_serial)

STEPS = 8
MODES = {
    "od-sgd": dict(delay=hvd.Delay("od-sgd", warmup_steps=2)),
    "od-sgd-dcasgd": dict(delay=hvd.Delay("od-sgd", warmup_steps=2, local_optimizer="dcasgd",
                                      dc_lambda=0.5, local_lr=0.2)),
    "ssd-sgd": dict(delay=hvd.Delay("ssd-sgd", warmup_steps=2, k=3, glu=0.5)),
    "cd-sgd-topk": dict(delay=hvd.Delay("cd-sgd", warmup_steps=2, k=3),
                    compression=hvd.Compression.topk(0.2, scope="bucket")),
    "cd-sgd-twobit": dict(delay=hvd.Delay("cd-sgd", warmup_steps=2, k=2),
                      compression=hvd.Compression.twobit(0.01)),
}


@pytest.fixture(scope="module", autouse=True)
def started():
    with default_dtype(torch.float64):
        hvd.init()
        yield


def build(**kw):
    model = Net()
    opt = hvd.DistributedOptimizer(make_opt(model), named_parameters=model.named_parameters(),
                                   **kw)
    return model, opt


def run(model, opt, steps, start=0, each_step=None):
    r = hvd.rank()
    for s in range(start, start + steps):
        x, y = data(s, hvd.size())
        opt.zero_grad()
        loss_fn(model, shard(x, r), shard(y, r)).backward()
        opt.step()
        if each_step:
            each_step(s)


def flat(tensors):
    return torch.cat([t.reshape(-1) for t in tensors])


@pytest.mark.parametrize("name", list(MODES))
def test_warm_up_over_the_whole_run_is_ssgd(name):
    kw = dict(MODES[name])
    kw["delay"] = hvd.Delay(kw["delay"].mode, warmup_steps=STEPS + 1)
    model, opt = build(**kw)
    run(model, opt, STEPS)
    assert_close(model, train_serial(STEPS))
    W = opt.global_weights()
    for n, p in model.named_parameters():
        assert torch.equal(W[n], p), n


@pytest.mark.parametrize("name", list(MODES))
def test_global_weights_agree_every_step(name):
    model, opt = build(**MODES[name])
    seen = []

    def agree(step):
        W = flat(opt.global_weights().values())
        assert torch.equal(hvd.allreduce(W, op=hvd.Max), hvd.allreduce(W, op=hvd.Min)), step
        seen.append(W.clone())
    run(model, opt, STEPS, each_step=agree)
    assert all(torch.isfinite(w).all() for w in seen)
    # the global weights move after the warm-up, and the local ones are not them (delayed)
    assert not torch.equal(seen[-1], seen[-2])
    local = flat(p.detach() for p in model.parameters())
    if hvd.size() > 1:
        assert not torch.equal(local, seen[-1])
    opt.finish_pending()  # local weights := global weights, the same everywhere
    assert_same_everywhere(model)
    assert torch.equal(flat(p.detach() for p in model.parameters()),
                       flat(opt.global_weights().values()))


@pytest.mark.parametrize("name", list(MODES))
def test_checkpoint_resumes_exactly(name):
    full_model, full_opt = build(**MODES[name])
    run(full_model, full_opt, STEPS)
    model, opt = build(**MODES[name])
    run(model, opt, 4)
    state = copy.deepcopy(opt.state_dict())   # waits for step 3's allreduce, applies nothing
    weights = copy.deepcopy(model.state_dict())
    run(model, opt, STEPS - 4, start=4)       # the original goes on after saving
    assert_close(model, full_model, tol=0)
    model2, opt2 = build(**MODES[name])
    model2.load_state_dict(weights)
    opt2.load_state_dict(state)
    run(model2, opt2, STEPS - 4, start=4)
    assert_close(model2, full_model, tol=0)
    W, W2 = full_opt.global_weights(), opt2.global_weights()
    for n in W:
        assert torch.equal(W[n], W2[n]), n


def test_od_the_local_step_by_hand():
    """One delayed step by hand: w = W - lr_local * (g + wd W), W one step behind."""
    model, opt = build(delay=hvd.Delay("od-sgd", warmup_steps=1, local_lr=0.3))
    run(model, opt, 1)                    # warm-up: W = w
    W0 = {n: w.clone() for n, w in opt.global_weights().items()}
    r = hvd.rank()
    x, y = data(1, hvd.size())
    opt.zero_grad()
    loss_fn(model, shard(x, r), shard(y, r)).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()                            # nothing averaged yet: W unchanged
    for n, p in model.named_parameters():
        assert torch.equal(opt.global_weights()[n], W0[n]), n
        expect = W0[n] - 0.3 * (grads[n] + 1e-3 * W0[n])
        assert torch.allclose(p, expect, atol=1e-12, rtol=0), n


def test_cd_every_kth_step_in_full_precision():
    """CD with k=3 after 2 warm-up steps: delayed steps j = 2, 5 (steps 4, 7) go dense; a
    step's bytes show in comm_stats one step later."""
    model, opt = build(**MODES["cd-sgd-topk"])
    dense = sum(p.numel() * 8 for p in model.parameters())
    payload = {}
    run(model, opt, STEPS, each_step=lambda s: payload.__setitem__(s - 1, opt.comm_stats.payload_bytes))
    assert payload[4] == dense, payload
    for s in (2, 3, 5, 6):
        assert payload[s] < dense / 2, (s, payload)


def test_bad_delays_raise_on_every_rank():
    odd = hvd.rank() == hvd.size() - 1
    expect_everywhere(lambda: build(delay="slow" if odd else "od-sgd"), "delay mode must be")
    expect_everywhere(lambda: build(delay="cd-sgd"), "needs a compressor")
    expect_everywhere(lambda: build(delay=hvd.Delay("ssd-sgd", k=0)), "k must be")
    expect_everywhere(lambda: build(delay="od-sgd", schedule="wfbp"), "cannot be combined")
    expect_everywhere(lambda: build(delay=hvd.Delay("od-sgd", local_optimizer="adam")),
                      "local_optimizer")
    model, opt = build(delay=hvd.Delay("od-sgd", warmup_steps=0))
    x, y = data(0, hvd.size())
    loss_fn(model, shard(x, hvd.rank()), shard(y, hvd.rank())).backward()
    expect_everywhere(opt.synchronize, "synchronize() is not available")
    opt.step()
    opt.finish_pending()

