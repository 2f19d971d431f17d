"""Environment adapters (not environments): the env registry, :mod:`rlfunc.envs.registry`."""
