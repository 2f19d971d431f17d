"""``rlfunc train ppo --env ENV`` for envs with a Dict observation (cameras, proprio, instruction):
Gaussian PPO through the multimodal encoder (:mod:`rlfunc.algos.ppo_encoder`); every
PPOEncoderConfig field is a flag."""

from __future__ import annotations

from rlfunc.cli.common import train_command


def train(name: str, argv: list[str]) -> int:
    """``rlfunc train ppo ARGV...`` (:func:`rlfunc.cli.common.train_command`) trained as ``name``
    ("ppo-encoder"); ``--nproc N``: N data-parallel ranks started by torchrun."""
    return train_command(name, argv, launch_as="ppo", check_env=False, also="evaluate it with `rlfunc eval {run_dir}`",
                         description="Train Gaussian PPO with a multimodal encoder (Dict observation: cameras, proprio, "
                         "instruction).")
