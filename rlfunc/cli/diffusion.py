"""``rlfunc train bc|dppo|td3-diffusion|sac-diffusion [...]``: every field of the algorithm's config (its actor spec
included, as ``--actor.FIELD``) is a flag; ``--demos N`` and ``--init RUN_DIR`` are short for
``--num-demos`` and ``--init-from``."""

from __future__ import annotations

from rlfunc.cli.common import train_command


# Short forms of two diffusion flags: `rlfunc train bc --demos N`, `rlfunc train dppo --init RUN_DIR`.
_ALIASES = {"--demos": "--num-demos", "--init": "--init-from"}


def _alias(arg: str) -> str:
    """``arg`` with a short flag spelled out, as ``--demos 5`` or ``--demos=5``."""
    flag, eq, value = arg.partition("=")
    return _ALIASES.get(flag, flag) + eq + value if flag in _ALIASES else arg


def _train(name: str, argv: list[str], what: str) -> int:
    """``rlfunc train NAME ARGV...`` (:func:`rlfunc.cli.common.train_command`) from the config's defaults."""
    return train_command(name, argv, rewrite=_alias, check_env=False, description=f"Train {what}.",
                         also="evaluate it with `rlfunc eval {run_dir}` or start a new run from it with `--init-from {run_dir}`")


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
