"""What a torch-batched env needs to split over the ranks of a data-parallel run (the registry's
``split=`` / ``any_done_of_split=``, :class:`rlfunc.envs.registry.EnvEntry`): :class:`SplitEnv`."""

from __future__ import annotations

from collections.abc import Callable

import torch
from tensordict import TensorDictBase

from rlfunc.errors import EnvError


class SplitEnv:
    """A mixin for a TorchRL ``EnvBase`` of N envs that may be rank r's part of a data-parallel run's
    W * N (put it before ``EnvBase`` in the bases). The env calls :meth:`set_split` in its
    ``__init__`` and draws its randomness for all W * N envs, keeping rows r N .. (r + 1) N - 1, so
    the ranks reset when the single process would: :meth:`any_done` is True after a step where an
    env of any rank is done, with "_reset" all False here when none of these is (the reset then
    only draws, as the single process's does)."""

    def set_split(self, split: tuple[int, int] | None, any_done_of_split: Callable[[bool], bool] | None) -> None:
        """Keep ``split`` = (rank, world_size) (None: (0, 1)) and ``any_done_of_split`` (the ranks'
        "is an env of any rank done", one collective; unused at world size 1).

        Raises:
            EnvError: ``split`` is not (rank, world_size) with 0 <= rank < world_size.
        """
        rank, world_size = (0, 1) if split is None else split
        if not 0 <= rank < world_size:
            raise EnvError(f"split={split!r}: expected (rank, world_size) with 0 <= rank < world_size")
        self._split = (rank, world_size)
        self._any_done_of_split = any_done_of_split if world_size > 1 else None

    def any_done(self, tensordict: TensorDictBase) -> bool:
        """TorchRL's check after a step (True: reset where "_reset"); see the class docstring."""
        done = bool(super().any_done(tensordict))
        if self._any_done_of_split is None or not self._any_done_of_split(done) or done:
            return done
        tensordict.set("_reset", torch.zeros(self.num_envs, 1, dtype=torch.bool, device=self.device))
        return True
