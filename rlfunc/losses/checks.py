"""Argument checks the losses share: a hyperparameter that is not a real number, or not a finite
one, is one ConfigError naming it (a str or None was a TypeError from a comparison, naming nothing;
inf passed "not x < 0" and gave inf targets)."""

from __future__ import annotations

import math
import numbers

from rlfunc.errors import ConfigError


def check_number(name: str, value, *, fn: str = "", finite: bool = True) -> None:
    """ConfigError unless ``value`` is a real number (not a bool), finite unless ``finite`` is False.
    ``fn``: the function, as the message's prefix ("grpo_loss: clip_epsilon='0.2': expected a number")."""
    prefix = f"{fn}: " if fn else ""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{prefix}{name}={value!r}: expected a number")
    if finite and not math.isfinite(value):
        raise ConfigError(f"{prefix}{name}={value!r}: expected a finite number")
