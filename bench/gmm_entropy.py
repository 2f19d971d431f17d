"""Time of DACER's entropy estimate (rlfunc.diffusion.entropy.gmm_entropy, torch EM) per call.

    python -m bench.gmm_entropy [--device cpu] [--threads 2]

256 states x 200 samples x A = 6, K = 3 full-covariance components, by EM iterations and estimate;
5 repeats after a warm-up, median and min in ms.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from rlfunc.diffusion.entropy import gmm_entropy


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(256, 200, 6, generator=g, device=device)
    print(f"device={device} threads={torch.get_num_threads()} torch={torch.__version__}")
    print("| iters | estimate | median ms | min ms |")
    print("|---|---|---|---|")
    for iters in (10, 20, 50):
        for estimate in ("samples", "mixture"):
            def run():
                out = gmm_entropy(x, 3, iters=iters, estimate=estimate, mc_samples=200, generator=g)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                return out
            run()
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                run()
                times.append(1e3 * (time.perf_counter() - t0))
            print(f"| {iters} | {estimate} | {statistics.median(times):.1f} | {min(times):.1f} |")


if __name__ == "__main__":
    main()
