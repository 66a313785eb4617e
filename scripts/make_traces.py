"""Write the per-layer traces of hvcomm/sim/traces/: each model's layers (hvcomm.sim.models,
built here) timed for a named GPU from their FLOPs and a stated sustained throughput, or
measured on this machine's CPU (hvcomm.sim.models.measured_profile, with hvcomm's
gradient-ready profiler).

    python scripts/make_traces.py                      # every model for every GPU below
    python scripts/make_traces.py --measure resnet20   # hvcomm/sim/traces/resnet20-cpu.json

A layer's forward time is its FLOPs times the batch over the GPU's sustained FLOP/s; its
backward time twice that (input and weight gradients, the usual estimate); the update reads
and writes 16 bytes per parameter (SGD with momentum, float32) at the GPU's memory bandwidth.
"""
from __future__ import annotations

import argparse
import json

import torch

import report
from hvcomm.sim.models import MODELS, layer_profile, measured_profile
from hvcomm.sim.profile import machine_of
from hvcomm.sim.simulate import TRACES

# peak float32 FLOP/s and memory bandwidth from the vendors' datasheets; the sustained
# fraction of peak is an assumption (cuDNN reaches 40-60% of fp32 peak on these layers)
GPUS = {
    "p102-100": dict(peak_flop_s=10.8e12, memory_b_s=440e9,
                     note="NVIDIA P102-100 (the gTop-k paper's GPU): 10.8 TFLOP/s fp32 peak"),
    "v100": dict(peak_flop_s=15.7e12, memory_b_s=900e9,
                 note="NVIDIA V100 SXM2: 15.7 TFLOP/s fp32 peak, 900 GB/s"),
    "a100": dict(peak_flop_s=19.5e12, memory_b_s=1555e9,
                 note="NVIDIA A100 40GB: 19.5 TFLOP/s fp32 peak (no TF32), 1555 GB/s"),
}
SUSTAINED = 0.5
BATCH = {"resnet20": 128, "resnet50": 64, "vgg16": 64, "bert-base": 32}


def trace(model: str, gpu: str) -> dict:
    spec = GPUS[gpu]
    flop_s = spec["peak_flop_s"] * SUSTAINED
    batch = BATCH[model]
    layers = layer_profile(model)
    params = sum(layer["params"] for layer in layers)
    return {
        "model": model, "batch": batch, "bytes_per_param": 4, "device": "gpu",
        "update_s": 16 * params / spec["memory_b_s"],
        "source": (f"estimated for {spec['note']}; sustained {SUSTAINED:.0%} of peak (assumed); "
                   f"forward = FLOPs x batch {batch} / sustained; backward = 2 x forward; "
                   "FLOPs from hvcomm.sim.models.layer_profile (scripts/make_traces.py)"),
        "layers": [{"name": layer["name"], "shapes": layer["shapes"], "params": layer["params"],
                    "forward_flops": layer["forward_flops"],
                    "forward_s": layer["forward_flops"] * batch / flop_s,
                    "backward_s": 2 * layer["forward_flops"] * batch / flop_s} for layer in layers],
    }


def measured(model: str, batch: int, steps: int) -> dict:
    profile = measured_profile(model, batch, steps)
    return {"model": model, "batch": batch, "bytes_per_param": 4, "device": "cpu",
            "measured_on": machine_of(torch.device("cpu")), "update_s": profile["update_s"],
            "source": (f"measured on this machine ({report.setting()['machine']}, torch "
                       f"{torch.__version__} with {torch.get_num_threads()} threads, commit "
                       f"{report.commit()}) by "
                       f"hvcomm.sim.models.measured_profile: median of {steps} steps at batch "
                       f"{batch} (scripts/make_traces.py --measure)"),
            "layers": profile["layers"]}


def write(path, data) -> None:
    path.write_text(json.dumps(data, indent=1) + "\n")
    step = sum(layer["forward_s"] + layer["backward_s"] for layer in data["layers"])
    print(f"{path.relative_to(TRACES.parent.parent)}: {len(data['layers'])} layers, "
          f"{sum(layer['params'] for layer in data['layers']) / 1e6:.1f}M parameters, "
          f"{step * 1e3:.1f} ms forward+backward at batch {data['batch']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--measure", choices=list(MODELS),
                    help="measure this model on this machine instead (writes <model>-cpu.json)")
    ap.add_argument("--batch", type=int, default=32, help="with --measure")
    ap.add_argument("--steps", type=int, default=5, help="with --measure")
    args = ap.parse_args()
    TRACES.mkdir(exist_ok=True)
    if args.measure:
        write(TRACES / f"{args.measure}-cpu.json", measured(args.measure, args.batch, args.steps))
        return
    for model in MODELS:
        for gpu in GPUS:
            write(TRACES / f"{model}-{gpu}.json", trace(model, gpu))


if __name__ == "__main__":
    main()
