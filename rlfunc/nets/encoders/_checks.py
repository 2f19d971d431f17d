"""Argument checks shared by the encoder modules and :class:`~rlfunc.nets.encoders.fusion.EncoderConfig`."""

from __future__ import annotations

from typing import Any

from rlfunc.errors import ConfigError


def _check_int(owner: str, name: str, value: Any, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{owner}: {name} must be an int >= {minimum}, got {value!r}")


def _check_widths(owner: str, widths: Any, blocks: Any, group_size: int) -> None:
    if not (isinstance(widths, tuple) and widths and all(isinstance(w, int) and w > 0 for w in widths)):
        raise ConfigError(f"{owner}: widths must be a non-empty tuple of positive ints, got {widths!r}")
    if not (isinstance(blocks, tuple) and len(blocks) == len(widths) and all(isinstance(b, int) and b > 0 for b in blocks)):
        raise ConfigError(f"{owner}: blocks must be positive ints, one per width ({len(widths)}), got {blocks!r}")
    bad = [w for w in widths if w % group_size]
    if bad:
        raise ConfigError(f"{owner}: group_size={group_size} must divide every width in {widths}; it does not divide {bad}")
