"""Warehouse-v0: a grid warehouse where AGVs shuttle between pick and drop stations.

- :mod:`envs.warehouse.layout`: :class:`WarehouseConfig` and the static grid;
- :mod:`envs.warehouse.core`: pure, batched torch dynamics (conflict resolution, tasks, observations);
- :mod:`envs.warehouse.env`: :class:`WarehouseEnv` (TorchRL, batched) and :class:`WarehouseParallelEnv` (PettingZoo);
- :mod:`envs.warehouse.expert`: the scripted baseline (prioritised planning with space-time reservations);
- :mod:`envs.warehouse.metrics`: deliveries / conflicts per 100 steps, idle fraction, policy evaluation.

Importing this package imports torch, torchrl and pettingzoo; ``import envs`` does not import it.
"""

from envs.warehouse.env import WarehouseEnv, WarehouseParallelEnv
from envs.warehouse.layout import Layout, WarehouseConfig, layout_from_ascii, make_layout

__all__ = ["Layout", "WarehouseConfig", "WarehouseEnv", "WarehouseParallelEnv", "layout_from_ascii", "make_layout"]
