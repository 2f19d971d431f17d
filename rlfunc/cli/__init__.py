"""The ``rlfunc`` command: train | eval | resume | versions, dispatched through the algorithm registry."""

from rlfunc.cli.commands import main

__all__ = ["main"]
