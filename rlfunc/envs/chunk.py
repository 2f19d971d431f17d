"""Gymnasium envs as a TorchRL env that executes action chunks: what the diffusion actors run on.

A diffusion actor emits a chunk of ``act_steps`` actions in [-1, 1] per decision (Chi et al. 2023,
"Diffusion Policy", open-loop execution of the first actions of the predicted horizon).
:class:`GymChunkEnv` holds N gymnasium envs (``gymnasium.make(env_id)``, the registered time limit
included) and, per TorchRL step, executes each env's chunk open loop until the chunk ends or the
episode does (the rest of the chunk is dropped), summing the rewards.

Observations become tensors at this boundary, once per step for the whole batch (one host-to-device
copy per key, images kept uint8):

- a ``Box`` observation space -> "observation" float32 ``[N, D]``;
- a ``Dict`` space -> one key per ``Box`` entry with its dtype (e.g. "top", "side" uint8
  ``[N, 128, 128, 3]``, "proprio" float32 ``[N, 16]``), and each ``Text`` entry NAME tokenised on the
  host by a cached :class:`rlfunc.nets.encoders.TextTokenizer` into "NAME_tokens" int64
  ``[N, max_len]`` and "NAME_padding_mask" bool ``[N, max_len]``.

Also in every step's output: "success" bool ``[N, 1]`` (``info["is_success"]``, False when the env
reports none) and "episode_return" float32 ``[N, 1]`` (the return of the current episode so far,
rewards unscaled). ``reset`` honours a partial "_reset" mask, so ``env.rollout(T, policy,
break_when_any_done=False)`` resets only the envs that ended.

A data-parallel rank holds its ``split`` of the single process's envs: every reset draws the seeds of
the envs that the single process would reset (every rank's done flags, gathered once per step by
``dones_of_split``) and keeps its own, so the ranks' envs together are the single process's envs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase
from torch import Tensor
from torchrl.data import Bounded, Categorical, Composite, Unbounded
from torchrl.envs import EnvBase

from rlfunc.envs import registry
from rlfunc.envs.collect import check_env_id, gym_spec, make_env
from rlfunc.envs.workers import ChunkPart, ChunkWorkers, batched
from rlfunc.errors import EnvError, ShapeError

# host-side numpy observations -> tensors; double-precision observations become float32 here
_NUMPY_TO_TORCH = {np.dtype(np.uint8): torch.uint8, np.dtype(np.float32): torch.float32,
                   np.dtype(np.float64): torch.float32, np.dtype(np.int64): torch.int64}  # ok-float64: host input dtype only


def action_bounds(space: gym.Space, env_id: str) -> tuple[np.ndarray, np.ndarray]:
    """(low, high) float32 ``[A]`` of a bounded 1-D ``Box`` action space; EnvError otherwise."""
    if not isinstance(space, gym.spaces.Box) or len(space.shape) != 1 or not space.is_bounded("both"):
        raise EnvError(f"env={env_id!r}: action space {space}: expected a bounded 1-D Box (a diffusion actor emits [-1, 1])")
    return space.low.astype(np.float32), space.high.astype(np.float32)


def scale_action(action: np.ndarray | Tensor, low, high):
    """[-1, 1] -> [low, high] (affine, per dimension): ``low + (a + 1) (high - low) / 2``."""
    return low + (action + 1.0) * (high - low) / 2.0


def unscale_action(action: np.ndarray | Tensor, low, high):
    """[low, high] -> [-1, 1], the inverse of :func:`scale_action`."""
    return 2.0 * (action - low) / (high - low) - 1.0


class ObservationCodec:
    """Gymnasium observations -> a TensorDict of the keys in the module docstring (batched on the host,
    copied once per key). ``instructions``: the corpus fixing the tokeniser's vocabulary (Text entries).

    Raises:
        EnvError: an observation space other than a Box or a Dict of Box and Text entries.
    """

    def __init__(self, space: gym.Space, env_id: str, instructions: Sequence[str] = (), max_len: int = 16) -> None:
        self.space, self.env_id = space, env_id
        self.tokenizer = None
        if isinstance(space, gym.spaces.Box):
            self.boxes = {"observation": space}
            self.texts: tuple[str, ...] = ()
        elif isinstance(space, gym.spaces.Dict):
            self.boxes = {k: s for k, s in space.spaces.items() if isinstance(s, gym.spaces.Box)}
            self.texts = tuple(k for k, s in space.spaces.items() if isinstance(s, gym.spaces.Text))
            other = [k for k in space.spaces if k not in self.boxes and k not in self.texts]
            if other:
                raise EnvError(f"env={env_id!r}: observation entries {other}: expected Box or Text entries")
            if self.texts:
                from rlfunc.nets.encoders import TextTokenizer

                self.tokenizer = TextTokenizer.from_instructions(instructions, max_len)
        else:
            raise EnvError(f"env={env_id!r}: observation space {type(space).__name__}: expected a Box or a Dict")
        for k, s in self.boxes.items():
            if np.dtype(s.dtype) not in _NUMPY_TO_TORCH:
                raise EnvError(f"env={env_id!r}: observation {k!r} has dtype {s.dtype}: expected uint8, float32/64 or int64")

    @property
    def is_dict(self) -> bool:
        return isinstance(self.space, gym.spaces.Dict)

    def spec(self, n: int, device: torch.device) -> dict:
        """TorchRL specs of the keys, batch ``[n]``."""
        out = {}
        for k, s in self.boxes.items():
            dtype = _NUMPY_TO_TORCH[np.dtype(s.dtype)]
            if dtype == torch.uint8:
                out[k] = Bounded(low=0, high=255, shape=(n, *s.shape), dtype=dtype, device=device)
            else:
                out[k] = Unbounded(shape=(n, *s.shape), dtype=dtype, device=device)
        for k in self.texts:
            m = self.tokenizer.max_len
            out[f"{k}_tokens"] = Bounded(low=0, high=self.tokenizer.vocab_size - 1, shape=(n, m), dtype=torch.int64, device=device)
            out[f"{k}_padding_mask"] = Categorical(2, shape=(n, m), dtype=torch.bool, device=device)
        return out

    def encode(self, observations: Any, device: torch.device, *, copy: bool = False) -> dict[str, Tensor]:
        """N gymnasium observations -> {key: tensor [N, ...]} on ``device``, in one copy per key.

        ``observations``: batched (:meth:`rlfunc.envs.workers.ChunkPart.batched`: a Box observation as
        one array [N, ...], a Dict as {key: array [N, ...]} with its Text entries as sequences of N
        strings) or a list of N observations. ``copy``: the arrays are reused (a worker's shared
        memory, :class:`rlfunc.envs.workers.ChunkWorkers`), so the tensors never share their memory."""
        if isinstance(observations, list):
            observations = batched(observations, self.is_dict)
        out = {}
        for k, s in self.boxes.items():
            rows = observations if not self.is_dict else observations[k]
            out[k] = torch.as_tensor(rows).to(device=device, dtype=_NUMPY_TO_TORCH[np.dtype(s.dtype)], copy=copy)
        for k in self.texts:
            tokens, pad = self.tokenizer(list(observations[k]))
            out[f"{k}_tokens"], out[f"{k}_padding_mask"] = tokens.to(device), pad.to(device)
        return out

    @property
    def keys(self) -> list[str]:
        return [*self.boxes, *(f"{k}_{s}" for k in self.texts for s in ("tokens", "padding_mask"))]


def env_instructions(env_id: str) -> tuple[str, ...]:
    """The instruction corpus an env declares (``INSTRUCTIONS`` of its module), else ()."""
    import importlib

    registry.ensure_loaded()  # the env plugins register their gymnasium ids

    entry = gym_spec(env_id).entry_point
    if isinstance(entry, str):
        return tuple(getattr(importlib.import_module(entry.split(":")[0]), "INSTRUCTIONS", ()))
    return ()


class GymChunkEnv(EnvBase):
    """N gymnasium envs stepped one action chunk at a time (see the module docstring).

    Args:
        env_id: a registered gymnasium id (rlfunc's envs are registered on import) with a bounded
            1-D Box action space.
        num_envs: N >= 1.
        act_steps: actions per chunk; the action is ``[N, act_steps, A]`` in [-1, 1] (``[N, A]`` when
            ``act_steps == 1``), scaled affinely to the action space's bounds.
        device: where the output tensors live (the envs step on the host).
        seed: env i's first reset uses a seed drawn from ``numpy.random.default_rng(seed)``; each later
            reset of an env draws the next one.
        workers: 0: the envs step in this process (:class:`rlfunc.envs.workers.ChunkPart`); K >= 1: in
            K worker processes, ``num_envs / K`` each (:class:`~rlfunc.envs.workers.ChunkWorkers`;
            observations in shared memory, images uint8 until the copy to ``device``), with the same outputs for the
            same seed and actions (the reset seeds are drawn here) and the same :meth:`episode_state`.
        split: None, or (rank, world_size): these N envs are envs rank*N .. (rank+1)*N - 1 of the
            world_size*N envs of ``seed`` in one process: the same reset seeds at the first reset and at
            every later one, however the ranks' episodes end (each reset draws the seeds of every env of
            the split that resets, in env order, and keeps its rows; so :meth:`rng_state` is the single
            process's on every rank).
        dones_of_split: with ``split`` over more than one rank, ``fn(done [N] bool tensor) -> [world_size*N]
            bool``: every rank's done flags after a step, in rank order (a collective every rank calls
            once per step, in :meth:`any_done`, and in a partial :meth:`reset` not preceded by one).

    Raises:
        EnvError: an unknown id, an unbounded action space, an observation space it cannot encode,
            ``num_envs`` or ``act_steps`` < 1, ``num_envs`` not divisible by ``workers``, ``split`` not
            (rank, world_size) with 0 <= rank < world_size, or a split over more than one rank without
            ``dones_of_split``.
    """

    def __init__(self, env_id: str, num_envs: int, *, act_steps: int = 1, device: torch.device | str | None = None,
                 seed: int | None = None, workers: int = 0, split: tuple[int, int] | None = None,
                 dones_of_split: Callable[[Tensor], Tensor] | None = None) -> None:
        for name, value in (("num_envs", num_envs), ("act_steps", act_steps)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise EnvError(f"{name}={value!r}: expected an int >= 1")
        rank, world_size = (0, 1) if split is None else split
        if not (isinstance(rank, int) and isinstance(world_size, int) and 0 <= rank < world_size):
            raise EnvError(f"split={split!r}: expected (rank, world_size) with 0 <= rank < world_size")
        if world_size > 1 and dones_of_split is None:
            raise EnvError(f"dones_of_split=None with split={split!r}: a split env needs every rank's done flags "
                           "after each step to draw the reset seeds as one process does")
        self._split, self._dones_of_split = (rank, world_size), (dones_of_split if world_size > 1 else None)
        self._pending = None  # every rank's reset mask [world_size*N], gathered by any_done for the reset that follows
        check_chunk_env_id(env_id)
        device = torch.device("cpu") if device is None else torch.device(device)
        super().__init__(device=device, batch_size=torch.Size([num_envs]))
        self.env_id, self.num_envs, self.act_steps, self.workers = env_id, num_envs, act_steps, workers
        if workers:
            from rlfunc.envs.workers import worker_slices

            worker_slices(num_envs, workers)  # EnvError naming both, before anything is built
            first = make_env(env_id)  # the spaces, in this process (nothing is rendered)
            first.close()
        else:
            self._part = ChunkPart(env_id, num_envs)
            first = self._part.envs[0]
        space = first.observation_space
        self.low, self.high = action_bounds(first.action_space, env_id)
        self.codec = ObservationCodec(space, env_id, env_instructions(env_id))
        self.max_episode_steps = first.spec.max_episode_steps if first.spec else None
        if workers:
            self._part = ChunkWorkers(env_id, num_envs, workers, space)
        n, a = num_envs, self.low.shape[0]
        self.act_dim = a
        flag = Categorical(2, shape=(n, 1), dtype=torch.bool, device=device)
        self.observation_spec = Composite(
            **self.codec.spec(n, device),
            success=flag.clone(),
            episode_return=Unbounded(shape=(n, 1), dtype=torch.float32, device=device),
            shape=(n,), device=device,
        )
        act_shape = (n, a) if act_steps == 1 else (n, act_steps, a)
        self.action_spec = Bounded(low=-1.0, high=1.0, shape=act_shape, dtype=torch.float32, device=device)
        self.reward_spec = Unbounded(shape=(n, 1), dtype=torch.float32, device=device)
        self.done_spec = Composite(done=flag.clone(), terminated=flag.clone(), truncated=flag.clone(), shape=(n,), device=device)
        self._obs = None  # the current observations, batched (ChunkPart.batched)
        self._return = np.zeros(n, np.float32)
        self._success = np.zeros(n, bool)
        self.set_seed(seed)

    @property
    def envs(self) -> list[gym.Env]:
        """The gymnasium envs, when they step in this process (``workers=0``).

        Raises:
            AttributeError: they step in worker processes."""
        if self.workers:
            raise AttributeError(f"the {self.env_id} envs step in {self.workers} worker processes: their gymnasium envs are not here")
        return self._part.envs

    def _set_seed(self, seed: int | None) -> None:
        self._rng = np.random.default_rng(seed)

    def rng_state(self) -> dict:
        """The state of the numpy generator that draws each reset's seed (``bit_generator.state``,
        JSON-able). A rollout that starts with a full reset depends on nothing else of the env."""
        return self._rng.bit_generator.state

    def set_rng_state(self, state: dict) -> None:
        """Put back a :meth:`rng_state`.

        Raises:
            EnvError: ``state`` is not a state of this env's bit generator (PCG64).
        """
        try:
            self._rng.bit_generator.state = state
        except (TypeError, ValueError, KeyError) as e:
            raise EnvError(f"state: not a {type(self._rng.bit_generator).__name__} state from rng_state() ({e})") from None

    def episode_state(self) -> dict | None:
        """What the envs carry from one step to the next besides :meth:`rng_state`, JSON-able, or None
        when a gymnasium env's state cannot be captured: per env its own RNG, time-limit counter and
        physics (:func:`rlfunc.envs.collect.env_state`: MuJoCo's integration state, or a classic-control
        ``state`` array), and the current episodes' "episode_return" and "success" (lists of N)."""
        envs = self._part.env_state()
        if envs is None:
            return None
        return {"envs": envs, "episode_return": self._return.tolist(), "success": self._success.tolist()}

    def set_episode_state(self, state: dict) -> None:
        """Put back an :meth:`episode_state` into envs that have been reset once: the next step
        continues each episode where it was. The observations to act on are not part of it (keep the
        output that came with the state).

        Raises:
            EnvError: ``state`` does not fit these envs (number of envs, keys, physics size).
        """
        try:
            self._part.set_env_state(state["envs"])
            self._return[:] = np.asarray(state["episode_return"], np.float32)
            self._success[:] = np.asarray(state["success"], bool)
        except (KeyError, TypeError, ValueError) as e:  # EnvError is a ValueError
            raise EnvError(f"state: not an episode_state() of {self.num_envs} {self.env_id} envs ({e})") from None

    def _output(self, terminated=None, truncated=None, reward=None) -> TensorDict:
        n, dev = self.num_envs, self.device
        out = self.codec.encode(self._obs, dev, copy=bool(self.workers))  # workers: views of shared memory
        # copies: the host arrays are updated in place by later steps and resets (from_numpy shares memory)
        flags = lambda x: torch.from_numpy(np.array(x, bool).reshape(n, 1)).to(dev)  # noqa: E731
        out["success"] = flags(self._success)
        out["episode_return"] = torch.from_numpy(self._return.reshape(n, 1).copy()).to(dev)
        term = np.zeros(n, bool) if terminated is None else terminated
        trunc = np.zeros(n, bool) if truncated is None else truncated
        out.update(terminated=flags(term), truncated=flags(trunc), done=flags(term | trunc))
        if reward is not None:
            out["reward"] = torch.from_numpy(reward.reshape(n, 1).copy()).to(dev)
        return TensorDict(out, batch_size=self.batch_size, device=dev)

    def any_done(self, tensordict: TensorDictBase) -> bool:
        """TorchRL's check after a step (True: reset where "_reset"); with a split over several ranks,
        True when an env of any rank is done (every rank's flags gathered by ``dones_of_split``, kept
        for the reset), with "_reset" all False here when none of these is (the reset then draws the
        other ranks' seeds, as the single process's does)."""
        done = bool(super().any_done(tensordict))
        if self._dones_of_split is None:
            return done
        n = self.num_envs
        here = tensordict.get("_reset").reshape(n).cpu() if done else torch.zeros(n, dtype=torch.bool)
        everyone = self._gather_dones(here)
        if not everyone.any():
            return False
        if not done:
            tensordict.set("_reset", torch.zeros(n, 1, dtype=torch.bool, device=self.device))
        self._pending = everyone
        return True

    def _gather_dones(self, here: Tensor) -> np.ndarray:
        rank, world_size = self._split
        everyone = np.asarray(self._dones_of_split(here.to(torch.bool)).detach().cpu().numpy(), bool).reshape(-1)
        n = self.num_envs
        if everyone.shape != (world_size * n,) or not np.array_equal(everyone[rank * n:(rank + 1) * n], here.numpy()):
            raise EnvError(f"dones_of_split: returned {everyone.astype(int).tolist()}: expected the {world_size * n} done "
                           f"flags of every rank, in rank order, with this rank's {here.int().tolist()} at {rank * n}..")
        return everyone

    def _reset_seeds(self, mask: Tensor | None) -> tuple[np.ndarray, list[int]]:
        """(the envs to reset, their seeds): the seeds of every env of the split that resets, drawn in
        env order (all of them without ``mask``), this rank's kept."""
        rank, world_size = self._split
        n = self.num_envs
        pending, self._pending = self._pending, None
        if mask is None:
            everyone = np.ones(world_size * n, bool)
        else:
            here = mask.reshape(n).to(device="cpu", dtype=torch.bool)
            if world_size == 1:
                everyone = here.numpy()
            else:
                everyone = pending if pending is not None and np.array_equal(pending[rank * n:(rank + 1) * n], here.numpy()) \
                    else self._gather_dones(here)
        resets = np.flatnonzero(everyone)
        seeds = [int(self._rng.integers(2**31)) for _ in resets]  # in env order, wherever the envs step
        mine = (resets >= rank * n) & (resets < (rank + 1) * n)
        return resets[mine] - rank * n, [s for s, m in zip(seeds, mine) if m]

    def _reset(self, tensordict: TensorDictBase | None = None, **kwargs) -> TensorDict:
        mask = None if tensordict is None else tensordict.get("_reset", None)
        which, seeds = self._reset_seeds(mask)
        self._obs, success = self._part.reset(which.tolist(), seeds)
        self._return[which] = 0.0
        self._success[which] = success
        return self._output()

    def _step(self, tensordict: TensorDictBase) -> TensorDict:
        n = self.num_envs
        action = tensordict["action"]
        if tuple(action.shape) != tuple(self.action_spec.shape):  # [N, A] for a chunk of 3 ran each number as a sub-step
            raise ShapeError(f"{self.env_id}: action of shape {list(action.shape)}, expected {list(self.action_spec.shape)} "
                             f"(num_envs, {'' if self.act_steps == 1 else 'act_steps, '}action dim)")
        action = action.detach().to("cpu", torch.float32).numpy().reshape(n, self.act_steps, -1)
        action = scale_action(np.clip(action, -1.0, 1.0), self.low, self.high)
        self._obs, reward, terminated, truncated, self._success[:] = self._part.step(action)
        self._return += reward
        return self._output(terminated, truncated, reward)

    def close(self, *, raise_if_closed: bool = True) -> None:  # noqa: D102
        if getattr(self, "_part", None) is not None:
            self._part.close()
            self._part = None
        super().close(raise_if_closed=raise_if_closed)


def check_chunk_env_id(env_id: str) -> None:
    """EnvError unless ``env_id`` is registered with gymnasium (after rlfunc's envs register)."""
    registry.ensure_loaded()  # the env plugins register their gymnasium ids
    if isinstance(env_id, str) and ":" in env_id:  # "module:EnvName-v0": the module registers it (collect.check_env_id)
        return check_env_id(env_id)
    if not isinstance(env_id, str) or env_id not in gym.registry:
        close = [k for k in gym.registry if isinstance(env_id, str) and env_id.lower()[:4] in k.lower()][:5]
        hint = f" (similar: {', '.join(close)})" if close else ""
        raise EnvError(f"env={env_id!r}: not a registered gymnasium id{hint}")
