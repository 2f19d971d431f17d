"""PointReach-v0: dppo with the output-noise likelihood, and td3-diffusion from scratch and from BC.

Needs the BC run of `python -m bench.point_reach --seeds 0` (bench/out/point_reach/bc-s0).

    python -m bench.diffusion_variants
"""

from __future__ import annotations

import json
import shutil
import time

import torch

from rlfunc.config import replace
from rlfunc.algos.dppo import DPPOConfig
from rlfunc.algos.td3_diffusion import TD3DiffusionConfig
from rlfunc.run import train

BC = "bench/out/point_reach/bc-s0"
OUT = "bench/out/point_reach_extra"


def main() -> None:
    torch.set_num_threads(1)
    shutil.rmtree(OUT, ignore_errors=True)
    runs = [
        ("dppo output-noise from bc-s0", train, replace(DPPOConfig(), init_from=BC, likelihood="output-noise", eval_episodes=1000, device="cpu")),
        ("td3-diffusion from scratch (horizon 1)", train, replace(TD3DiffusionConfig(), eval_episodes=1000, device="cpu")),
        ("td3-diffusion from bc-s0 (horizon 4)", train, replace(TD3DiffusionConfig(), init_from=BC, eval_episodes=1000, device="cpu")),
    ]
    for i, (name, fn, config) in enumerate(runs):
        t = time.perf_counter()
        result = fn(config, f"{OUT}/{i}", progress=False)
        print(json.dumps({"run": name, "wall_s": time.perf_counter() - t, **result.evaluation}), flush=True)


if __name__ == "__main__":
    main()
