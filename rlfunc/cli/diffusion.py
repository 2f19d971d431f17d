"""``rlfunc train bc|dppo|td3-diffusion|sac-diffusion [...]``: every field of the algorithm's config (its actor spec
included, as ``--actor.FIELD``) is a flag; ``--demos N`` and ``--init RUN_DIR`` are short for
``--num-demos`` and ``--init-from``."""

from __future__ import annotations

import argparse

from rlfunc.algos import registry
from rlfunc.cli.common import default_run_dir, launch, parse_config, report_run


# Short forms of two diffusion flags: `rlfunc train bc --demos N`, `rlfunc train dppo --init RUN_DIR`.
_ALIASES = {"--demos": "--num-demos", "--init": "--init-from"}


def _alias(arg: str) -> str:
    """``arg`` with a short flag spelled out, as ``--demos 5`` or ``--demos=5``."""
    flag, eq, value = arg.partition("=")
    return _ALIASES.get(flag, flag) + eq + value if flag in _ALIASES else arg


def _train(name: str, argv: list[str], what: str) -> int:
    """Parse ``argv`` into the config of ``name``'s entry, train it and print the evaluation
    as one JSON line (exit 0), or 130/143 when SIGINT/SIGTERM stopped it."""
    entry = registry.lookup(name)
    from rlfunc.run import train as fn

    cls = registry.resolve(entry.config)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--run-dir", default=None)
    known, rest = pre.parse_known_args(argv)
    rest = [_alias(a) for a in rest]
    config = parse_config(
        cls, args=rest, default=cls(),
        prog=f"rlfunc train {name}", description=f"Train {what}. Also: --run-dir DIR (default runs/ENV-{name}-sSEED-TIME).",
    )
    run_dir = known.run_dir or default_run_dir(config.env, name, config.run.seed)
    launched = launch(["train", name, *argv], config.run.nproc, run_dir)  # --nproc N: N ranks under torchrun
    if launched is not None:
        return launched
    result = fn(config, run_dir)
    return report_run(result, f"evaluate it with `rlfunc eval {result.run_dir}` or start a new run from it with "
                              f"`--init-from {result.run_dir}`")


def train_bc(name: str, argv: list[str]) -> int:
    """``rlfunc train bc [...]``."""
    return _train(name, argv, "diffusion behaviour cloning on the env's scripted-expert demonstrations")


def train_dppo(name: str, argv: list[str]) -> int:
    """``rlfunc train dppo [...]``."""
    return _train(name, argv, "PPO over the denoising chain of a diffusion actor (DPPO)")


def train_td3_diffusion(name: str, argv: list[str]) -> int:
    """``rlfunc train td3-diffusion [...]``."""
    return _train(name, argv, "TD3 with a diffusion actor (Diffusion-QL)")


def train_sac_diffusion(name: str, argv: list[str]) -> int:
    """``rlfunc train sac-diffusion [...]``."""
    return _train(name, argv, "SAC with a diffusion actor and a GMM entropy estimate (DACER)")
