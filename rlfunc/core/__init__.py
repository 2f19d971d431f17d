"""Pure operators, the leaves of the import graph: returns, distributions (Gaussian, tanh-Gaussian,
masked / MultiDiscrete categorical), sde, normalize, func, stats (device selection stays in rlfunc/device.py).
The public names are re-exported from ``rlfunc``."""
