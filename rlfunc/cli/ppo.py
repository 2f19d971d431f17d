"""``rlfunc train ppo --env ENV [...]``: every PPOConfig field is a flag, defaults from the env's preset
(an env with a Dict observation goes to the entry that accepts it: "ppo-encoder"); and how
``rlfunc eval`` evaluates a ppo run. A finished run is reported by
:func:`rlfunc.cli.common.report_run` (its final evaluation, which the run loop wrote to eval.json)."""

from __future__ import annotations

from pathlib import Path

from rlfunc.algos import registry
from rlfunc.algos.ppo import PPOConfig
from rlfunc.cli.common import Parser, train_command
from rlfunc.config import check_eval_seed


def train(name: str, argv: list[str]) -> int:
    """``rlfunc train ppo ARGV...`` (:func:`rlfunc.cli.common.train_command`) from the env's preset
    (``--shaping NAME``: with a gradient-shaping preset on top). An env that a variant of ``name``
    accepts (:func:`rlfunc.algos.registry.variant`) is that variant's command's."""
    from rlfunc.algos.ppo import preset
    from rlfunc.envs.collect import check_env_id

    pre = Parser(prog=f"rlfunc train {name}", add_help=False)  # a bad --env: one line
    pre.add_argument("--env", default=PPOConfig.env)
    known, rest = pre.parse_known_args(argv)
    if "-h" not in rest and "--help" not in rest:
        check_env_id(known.env)
    chosen = registry.variant(name, known.env)  # a Dict observation (cameras / proprio / instruction): ppo-encoder
    if chosen != name:
        return registry.resolve(registry.lookup(chosen).command)(chosen, argv)
    return train_command(
        name, argv, default=lambda env, shaping: preset(env, shaping=shaping), extra_flags=("--shaping",), check_env=False,
        description="Train PPO with a Gaussian actor (Box actions) or a categorical one (Discrete, MultiDiscrete). Defaults: "
        "the env's preset. --shaping ppo-shaped: the gradient-shaping preset on top of the env's (rlfunc.algos.ppo.SHAPING_PRESETS).",
    )


def evaluate(run_dir: str | Path, episodes: int | None = None, *, seed: int | None = None, device: str = "auto") -> dict:
    """:func:`rlfunc.run.ppo.evaluate` of ``run_dir``'s latest snapshot.

    Raises:
        ConfigError: ``seed`` outside [0, 2**31), or as :func:`rlfunc.run.ppo.evaluate`.
    """
    from rlfunc.run.ppo import evaluate

    check_eval_seed(seed)
    return evaluate(run_dir, episodes, seed=seed, device=device)
