"""``rlfunc train mappo --env Warehouse-v0|rware-tiny-2ag-v2 [--loss ppo|grpo|gspo] [...]``: every MAPPOConfig field is a flag."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time

from rlfunc.algos.mappo import MAPPOConfig


@dataclasses.dataclass(frozen=True)
class _LooseMAPPO(MAPPOConfig):
    """MAPPOConfig parsed without validation (tyro would box a ValueError); validated right after."""

    def __post_init__(self) -> None:
        pass


def train(argv: list[str]) -> int:
    """Parse ``argv`` into a MAPPOConfig, train, print the evaluation as one JSON line."""
    import argparse

    import tyro

    from rlfunc.train_mappo import train_mappo

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--run-dir", default=None)
    known, rest = pre.parse_known_args(argv)
    parsed = tyro.cli(
        _LooseMAPPO, args=rest, default=_LooseMAPPO(), prog="rlfunc train mappo",
        description="Shared-parameter multi-agent PPO (IPPO; --critic mean|concat: MAPPO's centralised critic) or "
        "its critic-free GRPO / GSPO variants (--loss grpo|gspo, grouped rollouts from one start state) on "
        "Warehouse-v0 or an rware id. Also: --run-dir DIR (default runs/ENV-mappo-LOSS-sSEED-TIME).",
    )
    config = MAPPOConfig(**dataclasses.asdict(parsed))  # validated here: errors print as one line
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = known.run_dir or os.path.join("runs", f"{config.env}-mappo-{config.loss}-s{config.seed}-{stamp}")
    result = train_mappo(config, run_dir)
    print(f"run dir: {result.run_dir}", file=sys.stderr)
    if result.interrupted:
        print(f"interrupted ({result.interrupted}): snapshot saved", file=sys.stderr)
        return 128 + int(getattr(signal, result.interrupted))
    print(json.dumps(result.evaluation))
    return 0
