"""``rlfunc train mappo --env Warehouse-v0|rware-tiny-2ag-v2 [--loss ppo|grpo|gspo] [...]``: every MAPPOConfig field is a flag."""

from __future__ import annotations

from rlfunc.cli.common import train_command


def train(name: str, argv: list[str]) -> int:
    """``rlfunc train mappo ARGV...`` (:func:`rlfunc.cli.common.train_command`) from the env's preset
    (:data:`rlfunc.algos.mappo.PRESETS`); the run dir is named by the loss too."""
    from rlfunc.algos.mappo import preset

    return train_command(
        name, argv, default=preset, check_env=False, tag=lambda config: f"{name}-{config.loss}",
        description="Shared-parameter multi-agent PPO (IPPO; --critic mean|concat: MAPPO's centralised critic) or "
        "its critic-free GRPO / GSPO variants (--loss grpo|gspo, grouped rollouts from one start state) on "
        "Warehouse-v0 or an rware id.",
    )
