"""Multi-layer perceptron skeleton."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from rlfunc.errors import ConfigError

_ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU, "elu": nn.ELU, "silu": nn.SiLU}


class MLP(nn.Sequential):
    """``in_features -> hidden... -> out_features`` with an activation between layers.

    Weights are orthogonally initialised (gain sqrt(2) for hidden layers, ``out_gain`` for the last),
    biases at zero, as in the PPO implementation details (Huang et al. 2022, detail 2). ``hidden``
    may be empty (one linear layer). ``activation``: one of "tanh", "relu", "elu", "silu".

    Raises:
        ConfigError: ``activation`` is not one of those names, or a width of ``hidden`` is not a positive int
            (0 built a network that ignores its input, -3 was torch's "negative dimension" traceback).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        hidden: Sequence[int] = (64, 64),
        activation: str = "tanh",
        out_gain: float = 1.0,
    ) -> None:
        if not isinstance(activation, str) or activation not in _ACTIVATIONS:
            raise ConfigError(f"MLP: activation={activation!r}: expected one of {', '.join(map(repr, _ACTIVATIONS))}")
        if any(isinstance(h, bool) or not isinstance(h, int) or h <= 0 for h in hidden):
            raise ConfigError(f"MLP: hidden={tuple(hidden)}: expected positive int widths")
        layers: list[nn.Module] = []
        sizes = [in_features, *hidden]
        for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
            layers += [_init(nn.Linear(fan_in, fan_out), math.sqrt(2.0)), _ACTIVATIONS[activation]()]
        layers.append(_init(nn.Linear(sizes[-1], out_features), out_gain))
        super().__init__(*layers)


def _init(layer: nn.Linear, gain: float) -> nn.Linear:
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.zeros_(layer.bias)
    return layer


def seeded_init(module_fn, seed: int) -> nn.Module:
    """Build a module with torch's global RNG forked and seeded, leaving the caller's RNG untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return module_fn()
