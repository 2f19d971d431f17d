"""``rlfunc train sac|td3 --env ENV [...]``: every field of the algorithm's config is a flag, defaults
from the env's preset (the ``preset`` function beside the config)."""

from __future__ import annotations

from rlfunc.algos import registry
from rlfunc.cli.common import train_command


def train(name: str, argv: list[str]) -> int:
    """``rlfunc train NAME ARGV...`` (:func:`rlfunc.cli.common.train_command`) from the preset of ``--env``."""
    preset = registry.resolve(f"{registry.lookup(name).config.partition(':')[0]}:preset")
    return train_command(name, argv, default=preset, description=f"Train {name} (an MLP actor, a replay buffer on the device). "
                         "Defaults: the env's preset.")
