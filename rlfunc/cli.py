"""The ``rlfunc`` command.

    rlfunc train ppo --env ENV_ID [--total-steps N] [--seed S] [--num-seeds N] [--device auto] [--run-dir DIR] [...]
                                            (an env with a Dict observation, e.g. Push-v0 or PusherPixels-v5:
                                            Gaussian PPO through the multimodal encoder, rlfunc.algos.ppo_encoder)
    rlfunc train bc [--env PointReach-v0|PushState-v0|Push-v0] [--demos N] [--actor.denoiser mlp|unet] [...]
                                            diffusion BC on the env's scripted-expert demos
    rlfunc train dppo [--env ENV_ID] [--init BC_RUN_DIR] [--likelihood chain|output-noise] [...]
    rlfunc train td3-diffusion [--init-from BC_RUN_DIR] [...]
    rlfunc train grpo|gspo --env ENV_ID [--num-groups N] [--group-size G] [...]   critic-free, grouped episodes
    rlfunc train mappo [--env Warehouse-v0|rware-tiny-2ag-v2] [--loss ppo|grpo|gspo] [--critic local|mean|concat]
                                            shared-parameter multi-agent policy (agents as a batch dim)
    rlfunc eval RUN_DIR [--episodes N]      one JSON line: mean, std, episodes and 95% CI of the return (ppo),
                                            success rate with its CI and goal shares (bc, dppo, td3-diffusion),
                                            eval.json's rates (mappo)
    rlfunc resume RUN_DIR [--total-steps N] [--snapshot NAME]
                                            continue a run from its latest snapshot (N: a new budget; NAME: an older snapshot)
    rlfunc versions list|show|diff|rollback RUN_DIR ...   a ppo run's versions (rlfunc versions --help)

Every config field is a flag of `train ALGO` (`rlfunc train ALGO --help`); ppo's defaults come from
the env's preset. Errors print as one line on stderr with exit code 2; a run stopped by SIGINT/SIGTERM
saves a snapshot and exits with 130/143.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
import typing
from pathlib import Path

from rlfunc.algos.bc import BCConfig
from rlfunc.algos.diffusion_actor import ActorSpec
from rlfunc.algos.dppo import DPPOConfig
from rlfunc.algos.ppo import PPOConfig
from rlfunc.algos.td3_diffusion import TD3DiffusionConfig
from rlfunc.cli_common import Parser, default_run_dir, report_run
from rlfunc.errors import ConfigError, RLFuncError, SnapshotCorruptError

USAGE = __doc__
ALGORITHMS = ("ppo", "bc", "dppo", "td3-diffusion", "grpo", "gspo", "mappo")


@dataclasses.dataclass(frozen=True)
class _Unchecked(PPOConfig):
    """PPOConfig parsed without validation (tyro would box a ValueError); validated right after."""

    def __post_init__(self) -> None:
        pass


def _train(argv: list[str]) -> int:
    import tyro

    from rlfunc.algos.ppo import preset
    from rlfunc.collect import check_env_id
    from rlfunc.train import train

    if not argv or argv[0] not in ALGORITHMS:
        got = repr(argv[0]) if argv else "nothing"
        raise ConfigError(f"algorithm: expected one of {', '.join(ALGORITHMS)} after `rlfunc train`, got {got}")
    if argv[0] == "mappo":  # shared-parameter multi-agent PPO / GRPO / GSPO (Warehouse-v0, rware)
        from rlfunc import cli_mappo

        return cli_mappo.train(argv[1:])
    if argv[0] in ("grpo", "gspo"):
        from rlfunc import cli_grpo

        return cli_grpo.train(argv[0], argv[1:])
    if argv[0] != "ppo":
        return _train_diffusion(argv[0], argv[1:])
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--env", default=PPOConfig.env)
    pre.add_argument("--run-dir", default=None)
    pre.add_argument("--shaping", default=None)
    known, rest = pre.parse_known_args(argv[1:])
    if "-h" not in rest and "--help" not in rest:
        check_env_id(known.env)
    from rlfunc.train_encoder import is_dict_env

    if is_dict_env(known.env):  # cameras / proprio / instruction: Gaussian PPO through the multimodal encoder
        from rlfunc import cli_ppo_encoder

        return cli_ppo_encoder.train(argv[1:])
    default = _Unchecked(**dataclasses.asdict(preset(known.env, shaping=known.shaping)))
    parsed = tyro.cli(
        _Unchecked, args=["--env", known.env, *rest], default=default, prog="rlfunc train ppo",
        description="Train PPO with a Gaussian actor. Defaults: the env's preset. "
        "Also: --run-dir DIR, the output directory (default runs/ENV-ppo-sSEED-TIME); "
        "--shaping ppo-shaped, the gradient-shaping preset on top of the env's (rlfunc.algos.ppo.SHAPING_PRESETS).",
    )
    config = PPOConfig(**dataclasses.asdict(parsed))  # validated here, so errors print as one line
    run_dir = known.run_dir or default_run_dir(config.env, "ppo", config.seed)
    return _report(train(config, run_dir))


def _convert(cls, obj):
    """Rebuild dataclass ``obj`` as ``cls`` field by field (nested config dataclasses included)."""
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        value = getattr(obj, f.name)
        values[f.name] = _convert(hints[f.name], value) if dataclasses.is_dataclass(hints[f.name]) else value
    return cls(**values)


@dataclasses.dataclass(frozen=True)
class _LooseActorSpec(ActorSpec):
    """Architecture and diffusion settings of the diffusion actor."""

    def __post_init__(self) -> None:
        pass


# Unvalidated subclasses of the diffusion configs for tyro (which would box a ValueError); defined
# here, in source, so that tyro finds the parents' field comments for --help.
@dataclasses.dataclass(frozen=True)
class _LooseBC(BCConfig):
    actor: _LooseActorSpec = dataclasses.field(default_factory=_LooseActorSpec)  # the actor to train

    def __post_init__(self) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class _LooseDPPO(DPPOConfig):
    actor: _LooseActorSpec = dataclasses.field(default_factory=_LooseActorSpec)  # ignored with --init-from (the snapshot's spec is used)

    def __post_init__(self) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class _LooseTD3(TD3DiffusionConfig):
    actor: _LooseActorSpec = dataclasses.field(  # ignored with --init-from (the snapshot's spec is used)
        default_factory=lambda: _convert(_LooseActorSpec, TD3DiffusionConfig().actor)
    )

    def __post_init__(self) -> None:
        pass


_LOOSE = {BCConfig: _LooseBC, DPPOConfig: _LooseDPPO, TD3DiffusionConfig: _LooseTD3}


# Short forms of two diffusion flags: `rlfunc train bc --demos N`, `rlfunc train dppo --init RUN_DIR`.
_ALIASES = {"--demos": "--num-demos", "--init": "--init-from"}


def _train_diffusion(algo: str, argv: list[str]) -> int:
    import tyro

    from rlfunc import train_diffusion as td

    cls, fn, what = {
        "bc": (BCConfig, td.train_bc, "diffusion behaviour cloning on the env's scripted-expert demonstrations"),
        "dppo": (DPPOConfig, td.train_dppo, "PPO over the denoising chain of a diffusion actor (DPPO)"),
        "td3-diffusion": (TD3DiffusionConfig, td.train_td3_diffusion, "TD3 with a diffusion actor (Diffusion-QL)"),
    }[algo]
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--run-dir", default=None)
    known, rest = pre.parse_known_args(argv)
    rest = [_ALIASES.get(a, a) for a in rest]
    loose = _LOOSE[cls]
    parsed = tyro.cli(
        loose, args=rest, default=_convert(loose, cls()),
        prog=f"rlfunc train {algo}", description=f"Train {what}. Also: --run-dir DIR (default runs/ENV-{algo}-sSEED-TIME).",
    )
    config = _convert(cls, parsed)  # validated here, so errors print as one line
    result = fn(config, known.run_dir or default_run_dir(config.env, algo, config.seed))
    return report_run(result, f"evaluate it with `rlfunc eval {result.run_dir}` or start a new run from it with "
                              f"`--init-from {result.run_dir}`")


def _report(result) -> int:
    print(f"run dir: {result.run_dir}", file=sys.stderr)
    if result.interrupted:
        print(f"interrupted ({result.interrupted}): snapshot saved; continue with `rlfunc resume {result.run_dir}`",
              file=sys.stderr)
        return 128 + int(getattr(signal, result.interrupted))
    from rlfunc.train import evaluate

    config = json.loads((Path(result.run_dir) / "config.json").read_text())
    summary = evaluate(result.run_dir, episodes=config["eval_episodes"], device=config["device"])
    (Path(result.run_dir) / "eval.json").write_text(json.dumps(summary) + "\n")
    print(json.dumps(summary))
    return 0


def _eval(argv: list[str]) -> int:
    from rlfunc.train import evaluate

    p = Parser(prog="rlfunc eval", description="Evaluate a run's latest snapshot.")
    p.add_argument("run_dir")
    p.add_argument("--episodes", type=int, default=None,
                   help="episodes to run (default: the run's eval_episodes; per eval seed for mappo)")
    p.add_argument("--seed", type=int, default=None, help="evaluation seed (default: derived from the run's seed)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | npu")
    a = p.parse_args(argv)
    from rlfunc import checkpoint

    snap = checkpoint.latest_snapshot(a.run_dir)
    if snap is None and (Path(a.run_dir) / "meta.json").is_file():
        snap = Path(a.run_dir)  # a snapshot directory
    if snap is not None and checkpoint.load_meta(snap).get("algo") in ("bc", "dppo", "td3-diffusion"):
        from rlfunc.train_diffusion import evaluate_run

        print(json.dumps(evaluate_run(a.run_dir, a.episodes, seed=a.seed, device=a.device)))
        return 0
    if snap is not None and checkpoint.load_meta(snap).get("algo") == "ppo-encoder":
        from rlfunc.train_encoder import evaluate_run as evaluate_encoder

        print(json.dumps(evaluate_encoder(snap, a.episodes, seed=a.seed, device=a.device)))
        return 0
    if snap is not None and checkpoint.load_meta(snap).get("algo") == "mappo":
        from rlfunc.train_mappo import evaluate_run as evaluate_mappo

        print(json.dumps(evaluate_mappo(snap, a.episodes, seed=a.seed, device=a.device)))
        return 0
    if snap is not None and checkpoint.load_meta(snap).get("algo") in ("grpo", "gspo"):
        from rlfunc.train_grpo import evaluate_run as evaluate_grpo

        print(json.dumps(evaluate_grpo(snap, a.episodes, seed=a.seed, device=a.device)))
        return 0
    if a.seed is not None and not 0 <= a.seed < 2**31:
        raise ConfigError(f"seed={a.seed}: expected an integer in [0, 2**31)")
    print(json.dumps(evaluate(a.run_dir, a.episodes, seed=a.seed, device=a.device)))
    return 0


def _resume(argv: list[str]) -> int:
    p = Parser(prog="rlfunc resume", description="Continue a run from its latest snapshot.")
    p.add_argument("run_dir")
    p.add_argument("--total-steps", type=int, default=None, help="a new budget: env steps per seed (ppo, mappo, grpo, dppo, td3-diffusion) or updates (bc)")
    p.add_argument("--snapshot", default=None, metavar="NAME",
                   help="continue from this snapshot of RUN_DIR/checkpoints (e.g. step_000000008192) instead of the latest (points 'latest' at it); "
                        "a ppo run with versions continues from its branch's head version when that is further along")
    p.add_argument("--device", default=None,
                   help="run on this device (auto | cpu | cuda | npu) instead of the run's own, from now on (later snapshots "
                        "record it); a run continues exactly only on the device type it ran on")
    a = p.parse_args(argv)
    from rlfunc import checkpoint

    before = None
    if a.snapshot is not None:
        before = checkpoint.latest_snapshot(a.run_dir)
        checkpoint.use_snapshot(a.run_dir, a.snapshot)
    snap = checkpoint.latest_snapshot(a.run_dir)
    try:
        return _resume_from(a, snap)
    except RLFuncError as e:
        # refused (these are raised before anything is run or saved): 'latest' names what it named
        if before is not None and before != snap and checkpoint.latest_snapshot(a.run_dir) == snap:
            checkpoint.use_snapshot(a.run_dir, before.name)
        if not isinstance(e, SnapshotCorruptError) or snap is None or str(snap) not in str(e):
            raise
        older = [p.name for p in checkpoint.run_snapshots(a.run_dir) if p.name < snap.name]
        if not older:
            raise
        from rlfunc import versions

        also = (" (this run keeps versions: it continues from its branch's head version when that is further along; "
                f"rlfunc versions list {a.run_dir})") if versions.has_versions(a.run_dir) else ""
        raise SnapshotCorruptError(f"{e}. Older snapshots: {', '.join(older)}; to continue from the newest of them: "
                                   f"rlfunc resume {a.run_dir} --snapshot {older[0]}{also}") from e


def _resume_from(a, snap) -> int:
    from rlfunc import checkpoint
    from rlfunc.train import train

    algo = checkpoint.load_meta(snap).get("algo") if snap is not None else None
    if algo == "mappo":
        from rlfunc.train_mappo import resume_mappo

        return report_run(resume_mappo(a.run_dir, a.total_steps, device=a.device))
    if algo in ("grpo", "gspo"):
        from rlfunc.train_grpo import resume_grpo

        return report_run(resume_grpo(a.run_dir, a.total_steps, device=a.device))
    if algo in ("bc", "dppo", "td3-diffusion"):
        from rlfunc.train_diffusion import resume_diffusion

        return report_run(resume_diffusion(a.run_dir, a.total_steps, device=a.device))
    if algo == "ppo-encoder":  # Gaussian PPO through the multimodal encoder (Dict observations)
        from rlfunc.train_encoder import resume_encoder

        return report_run(resume_encoder(a.run_dir, a.total_steps, device=a.device))
    return _report(train(PPOConfig(), a.run_dir, resume=True, total_steps=a.total_steps, device=a.device))


def _versions(argv: list[str]) -> int:
    from rlfunc import cli_versions

    return cli_versions.main(argv)


COMMANDS = {"train": _train, "eval": _eval, "resume": _resume, "versions": _versions}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if not argv or argv[0] not in COMMANDS:
        got = f"unknown command {argv[0]!r}" if argv else "no command"
        print(f"rlfunc: error: {got}; expected one of: {', '.join(COMMANDS)} (rlfunc --help)", file=sys.stderr)
        return 2
    try:
        return COMMANDS[argv[0]](argv[1:])
    except RLFuncError as e:
        print(f"rlfunc: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before training started or during the final evaluation
        print("rlfunc: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
