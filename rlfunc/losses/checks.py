"""Argument checks the losses share (ppo, dppo, grpo/gspo, sac, td3): a hyperparameter that is not
a real number, or not a finite one, is one ConfigError naming it (a str or None was a TypeError from a comparison, naming nothing;
inf passed "not x < 0" and gave inf targets)."""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

from rlfunc.core.func import reads_values
from rlfunc.errors import ConfigError


def check_number(name: str, value, *, fn: str = "", finite: bool = True) -> None:
    """ConfigError unless ``value`` is a real number (not a bool), finite unless ``finite`` is False.
    ``fn``: the function, as the message's prefix ("grpo_loss: clip_epsilon='0.2': expected a number")."""
    prefix = f"{fn}: " if fn else ""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{prefix}{name}={value!r}: expected a number")
    if finite and not math.isfinite(value):
        raise ConfigError(f"{prefix}{name}={value!r}: expected a finite number")


def check_coefficient(fn: str, name: str, value, *, positive: bool = False) -> None:
    """ConfigError naming ``name`` unless ``value`` is a finite real number (or tensor of them) that is
    >= 0 (> 0 with ``positive``); NaN passes ``value < 0``, so it is refused here explicitly. A tensor
    batched by torch.func.vmap (a sweep) or one under torch.compile is not read (the check is skipped)."""
    if not isinstance(value, Tensor):
        check_number(name, value, fn=fn, finite=False)
        ok = math.isfinite(value) and (value > 0 if positive else value >= 0)
    elif not reads_values(value):  # batched by vmap (a sweep of coefficients) or under compile: no host read
        return
    else:
        ok = bool((torch.isfinite(value) & ((value > 0) if positive else (value >= 0))).all())
    if not ok:
        raise ConfigError(f"{fn}: {name}={value}: expected a finite number {'> 0' if positive else '>= 0'}")
