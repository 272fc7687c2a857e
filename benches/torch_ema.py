"""Peer of `cargo bench --bench ema_update`: one update of torchvision's reference moving
average of the weights (its `ExponentialMovingAverage`: `AveragedModel` over parameters and
buffers, `decay * avg + (1 - decay) * weight`) on the same model, on the CPU, one thread.

/usr/bin/python3 benches/torch_ema.py [--model resnet50] [--reps 20]
"""

import argparse
import time

import torch
import torchvision


class ExponentialMovingAverage(torch.optim.swa_utils.AveragedModel):
    """torchvision's reference recipe: parameters and buffers averaged with a fixed decay."""

    def __init__(self, model, decay):
        def ema_avg(avg, weight, num_averaged):
            return decay * avg + (1.0 - decay) * weight

        super().__init__(model, torch.device("cpu"), ema_avg, use_buffers=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="resnet50")
    p.add_argument("--reps", type=int, default=20)
    a = p.parse_args()
    torch.set_num_threads(1)
    model = getattr(torchvision.models, a.model)(num_classes=1000)
    ema = ExponentialMovingAverage(model, 0.999)
    with torch.no_grad():
        for t in model.parameters():
            t.add_(1.0)
    ema.update_parameters(model)
    ema.update_parameters(model)
    times = []
    for _ in range(a.reps):
        t = time.perf_counter()
        ema.update_parameters(model)
        times.append(time.perf_counter() - t)
    times.sort()
    values = sum(t.numel() for t in model.state_dict().values())
    median = times[len(times) // 2]
    print(
        f"{a.model} moving-average update (torch {torch.__version__}): {values} values · "
        f"median {median * 1e3:.2f} ms · fastest {times[0] * 1e3:.2f} ms · "
        f"{values * 12 / median / 1e9:.1f} GB/s at the median"
    )


if __name__ == "__main__":
    main()
