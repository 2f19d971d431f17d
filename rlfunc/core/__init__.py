"""Pure operators, the leaves of the import graph: returns, distributions, sde, normalize, func, stats (device selection stays in rlfunc/device.py)."""
