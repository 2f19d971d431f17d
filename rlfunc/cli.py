"""The ``rlfunc`` command.

    rlfunc train ppo --env ENV_ID [--total-steps N] [--seed S] [--num-seeds N] [--device auto] [--run-dir DIR] [...]
    rlfunc eval RUN_DIR [--episodes N]      one JSON line: mean and std of the episodic return
    rlfunc resume RUN_DIR                   continue a run from its latest snapshot

Every PPOConfig field is a flag of ``train ppo`` (``rlfunc train ppo --help``); defaults come from the
env's preset. rlfunc's own errors print as one line on stderr with exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

from rlfunc.algos.ppo import PPOConfig
from rlfunc.errors import RLFuncError

USAGE = __doc__


def _train(argv: list[str]) -> int:
    import tyro

    from rlfunc.algos.ppo import preset
    from rlfunc.collect import check_env_id
    from rlfunc.train import train

    if not argv or argv[0] not in ("ppo",):
        raise SystemExit(f"usage: rlfunc train ppo --env ENV_ID [...]; algorithms: ppo (got {argv[:1]})")
    rest = argv[1:]
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--env", default=PPOConfig.env)
    pre.add_argument("--run-dir", default=None)
    known, rest = pre.parse_known_args(rest)
    check_env_id(known.env)
    default = _Unchecked(**dataclasses.asdict(preset(known.env)))
    parsed = tyro.cli(_Unchecked, args=["--env", known.env, *rest], default=default, prog="rlfunc train ppo",
                      description="Train PPO with a Gaussian actor. Defaults: the env's preset.")
    config = PPOConfig(**dataclasses.asdict(parsed))  # validated here, so errors print as one line
    run_dir = known.run_dir or os.path.join("runs", f"{config.env}-ppo-s{config.seed}-{time.strftime('%Y%m%d-%H%M%S')}")
    result = train(config, run_dir)
    _report(result)
    return 0


@dataclasses.dataclass(frozen=True)
class _Unchecked(PPOConfig):
    """PPOConfig parsed without validation (tyro would box a ValueError); validated right after."""

    def __post_init__(self) -> None:
        pass


def _report(result) -> None:
    print(f"run dir: {result.run_dir}", file=sys.stderr)
    if result.interrupted:
        print(f"interrupted: snapshot saved; continue with `rlfunc resume {result.run_dir}`", file=sys.stderr)
        return
    from rlfunc.train import evaluate

    config = json.loads((Path(result.run_dir) / "config.json").read_text())
    summary = evaluate(result.run_dir, episodes=config["eval_episodes"], device=config["device"])
    (Path(result.run_dir) / "eval.json").write_text(json.dumps(summary) + "\n")
    print(json.dumps(summary))


def _eval(argv: list[str]) -> int:
    from rlfunc.train import evaluate

    p = argparse.ArgumentParser(prog="rlfunc eval", description="Evaluate a run's latest snapshot.")
    p.add_argument("run_dir")
    p.add_argument("--episodes", type=int, default=10)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--device", default="auto")
    a = p.parse_args(argv)
    print(json.dumps(evaluate(a.run_dir, a.episodes, seed=a.seed, device=a.device)))
    return 0


def _resume(argv: list[str]) -> int:
    from rlfunc.train import train

    p = argparse.ArgumentParser(prog="rlfunc resume", description="Continue a run from its latest snapshot.")
    p.add_argument("run_dir")
    a = p.parse_args(argv)
    _report(train(PPOConfig(), a.run_dir, resume=True))
    return 0


COMMANDS = {"train": _train, "eval": _eval, "resume": _resume}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(USAGE, file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    try:
        return COMMANDS[argv[0]](argv[1:])
    except RLFuncError as e:
        print(f"rlfunc: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
