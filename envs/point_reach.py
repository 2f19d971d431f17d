"""PointReach-v0: a 2-D point mass that must reach either of two goals placed symmetrically about its start.

Both goals are equally good, so the optimal policy is bimodal: the test bed for multimodal (diffusion)
policies. Units: metres and seconds.

Episode: the start ``p0`` is uniform in [-1, 1]^2 and an axis angle ``theta`` uniform in [0, 2 pi);
the goals are ``g_a = p0 + D u(theta)`` and ``g_b = p0 - D u(theta)`` with ``u(theta) = (cos, sin)``.
An action ``a`` in [-1, 1]^2 (clipped; NaN counts as 0) is a velocity command:
``p <- p + DT * MAX_SPEED * clip(a)``. Reaching within ``SUCCESS_RADIUS`` of either goal terminates
the episode; ``MAX_STEPS`` steps truncate it.

Observation (float32 [6]): ``p`` (2), ``g_a - p`` (2), ``g_b - p`` (2), metres.

Reward per step (metres, plus a bonus): progress toward the nearest goal,
``min_i |g_i - p_t| - min_i |g_i - p_{t+1}|``, plus ``SUCCESS_BONUS`` on the success step, minus
``STEP_PENALTY``.

Three faces of the same dynamics, in float32 (tested: observations, termination and the goal reached
agree exactly; rewards to a rounding of the last bit, as torch's vectorised CPU square root and
numpy's differ there):

- a pure, batched torch core: :func:`reset_state`, :func:`step_state`, :func:`observation`;
- :class:`PointReachEnv`, a TorchRL ``EnvBase`` batched on a device, with optional action chunks;
- :class:`PointReachGymEnv`, a numpy gymnasium env registered as ``"PointReach-v0"`` by ``import envs``.

Plus :func:`mode_statistics` / :func:`rollout_mode_statistics` (which goal was reached) and a scripted
bimodal expert, :func:`expert_action` / :func:`collect_demonstrations`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import gymnasium as gym
import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase
from torch import Tensor
from torchrl.data import Bounded, Categorical, Composite, Unbounded
from torchrl.envs import EnvBase

from rlfunc.envs.split import SplitEnv
from rlfunc.errors import ConfigError, EnvError, ShapeError

GOAL_DISTANCE = 1.0  # D, metres from the start to each goal
MAX_SPEED = 1.0  # metres per second at |a_i| = 1
DT = 0.1  # seconds per env step
SUCCESS_RADIUS = 0.1  # metres; within this of a goal is success (squared distance <= SUCCESS_RADIUS**2)
MAX_STEPS = 30  # env steps (sub-steps when acting in chunks) before truncation
SUCCESS_BONUS = 1.0  # reward added on the success step
STEP_PENALTY = 0.01  # reward subtracted every step
START_RANGE = 1.0  # the start is uniform in [-START_RANGE, START_RANGE]^2, metres
OBS_DIM = 6  # p, g_a - p, g_b - p
ACT_DIM = 2  # velocity command (x, y)
STEP_LENGTH = DT * MAX_SPEED  # metres moved per step at full speed along one axis

_STATE_DIM = 8  # gym state: position (2), g_a (2), g_b (2), start (2)


def _check_count(name: str, value: object, error: type[Exception] = EnvError) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise error(f"{name}={value!r}: expected an int >= 1")
    return value


# ---------------------------------------------------------------------------------------------
# Pure torch core.


def reset_state(num_envs: int, generator: torch.Generator, device: torch.device | str | None = None) -> TensorDict:
    """Fresh episodes for ``num_envs`` envs.

    Args:
        num_envs: N >= 1.
        generator: the only source of randomness (three uniforms per env are drawn); on ``device``.
        device: where the state lives; ``None`` is the generator's device.

    Returns:
        TensorDict, batch [N], on ``device``: "position" [N, 2] float32 (m, equal to "start"),
        "goals" [N, 2, 2] float32 (m; [:, 0] is g_a, [:, 1] is g_b), "start" [N, 2] float32 (m),
        "step_count" [N, 1] int64 (0), "terminated" [N, 1] bool, "truncated" [N, 1] bool (False),
        "goal_index" [N, 1] int64 (-1: no goal reached yet).

    Raises:
        EnvError: ``num_envs`` is not an int >= 1.
        ShapeError: ``generator`` is on another device type than ``device``.
    """
    _check_count("num_envs", num_envs)
    device = generator.device if device is None else torch.device(device)
    if generator.device.type != device.type:
        raise ShapeError(f"generator is on {generator.device}, device={device}: expected the same device")
    u = torch.rand(num_envs, 3, generator=generator, device=device)
    start = (u[:, :2] * 2.0 - 1.0) * START_RANGE
    theta = u[:, 2] * (2.0 * math.pi)
    axis = torch.stack([torch.cos(theta), torch.sin(theta)], dim=-1) * GOAL_DISTANCE
    return TensorDict(
        {
            "position": start.clone(),
            "goals": torch.stack([start + axis, start - axis], dim=1),
            "start": start,
            "step_count": torch.zeros(num_envs, 1, dtype=torch.int64, device=device),
            "terminated": torch.zeros(num_envs, 1, dtype=torch.bool, device=device),
            "truncated": torch.zeros(num_envs, 1, dtype=torch.bool, device=device),
            "goal_index": torch.full((num_envs, 1), -1, dtype=torch.int64, device=device),
        },
        batch_size=[num_envs],
        device=device,
    )


def _goal_sq_distance(goals: Tensor, position: Tensor) -> Tensor:
    """[..., 2] squared distance to each goal (m^2), written out so numpy computes the same float32 bits.

    Success and the nearest goal are decided on these exact values; only the reward goes through a
    square root, which torch's vectorised CPU kernel rounds differently from numpy in the last bit.
    """
    d = goals - position.unsqueeze(-2)
    return (d * d).sum(-1)


def step_state(state: TensorDict, action: Tensor) -> tuple[TensorDict, Tensor, Tensor, Tensor, Tensor]:
    """One env step (DT seconds) of every env: ``p <- p + DT * MAX_SPEED * clip(a, -1, 1)``.

    An env whose episode has ended (terminated or truncated, not reset since) is absorbing: its
    position and step count stay, its reward is 0 and its flags and goal index are reported again.

    Args:
        state: a TensorDict as from :func:`reset_state`, batch [N].
        action: [N, 2] float velocity command; clipped to [-1, 1], NaN counts as 0.

    Returns:
        (new_state, reward [N, 1] float32, terminated [N, 1] bool, truncated [N, 1] bool,
        goal_index [N, 1] int64). reward is progress toward the nearest goal (m) + SUCCESS_BONUS on
        the success step - STEP_PENALTY; terminated means within SUCCESS_RADIUS of a goal; truncated
        means MAX_STEPS steps taken (both can be set on the same step); goal_index is 0 (g_a) or
        1 (g_b) for the goal reached, -1 otherwise.

    Raises:
        ShapeError: ``action`` is not [N, 2].
    """
    position = state["position"]
    n = position.shape[0]
    if action.shape != (n, ACT_DIM):
        raise ShapeError(f"action shape {tuple(action.shape)}: expected ({n}, {ACT_DIM})")
    goals = state["goals"]
    ended = state["terminated"] | state["truncated"]
    active = ~ended
    a = torch.nan_to_num(action.to(position.dtype), nan=0.0).clamp(-1.0, 1.0)
    moved = position + STEP_LENGTH * a
    new_position = torch.where(active, moved, position)
    before = _goal_sq_distance(goals, position).amin(-1, keepdim=True).sqrt()
    after_sq, nearest = _goal_sq_distance(goals, new_position).min(-1, keepdim=True)
    after = after_sq.sqrt()
    success = active & (after_sq <= SUCCESS_RADIUS**2)
    reward = (before - after) + SUCCESS_BONUS * success.to(position.dtype) - STEP_PENALTY
    reward = torch.where(active, reward, torch.zeros_like(reward))
    step_count = state["step_count"] + active.to(torch.int64)
    terminated = state["terminated"] | success
    truncated = state["truncated"] | (active & (step_count >= MAX_STEPS))
    goal_index = torch.where(success, nearest, state["goal_index"])
    new_state = TensorDict(
        {
            "position": new_position,
            "goals": goals,
            "start": state["start"],
            "step_count": step_count,
            "terminated": terminated,
            "truncated": truncated,
            "goal_index": goal_index,
        },
        batch_size=state.batch_size,
        device=state.device,
    )
    return new_state, reward, terminated, truncated, goal_index


def observation(state: TensorDict) -> Tensor:
    """[N, 6] float32 observation: position p (2), g_a - p (2), g_b - p (2), metres."""
    p = state["position"]
    goals = state["goals"]
    return torch.cat([p, goals[:, 0] - p, goals[:, 1] - p], dim=-1)


def _reset_where(state: TensorDict, mask: Tensor, fresh: TensorDict) -> TensorDict:
    """Reset the envs where ``mask`` [N] is True to ``fresh`` (a :func:`reset_state` drawn for every
    env, so the generator advances the same whichever envs reset), keep the others."""
    return fresh.apply(
        lambda f, s: torch.where(mask.view(-1, *([1] * (f.ndim - 1))), f, s), state
    )


# ---------------------------------------------------------------------------------------------
# Which goal was reached.


def rollout_mode_statistics(td: TensorDictBase) -> TensorDict:
    """:func:`mode_statistics` of a rollout TensorDict, kept on its device (no host sync).

    Args:
        td: a rollout with ("next", "goal_index") int64 and ("next", "done") bool of the same shape
            (any batch shape, e.g. [N, T, 1] from ``env.rollout``).

    Returns:
        TensorDict with batch size [] of 0-d tensors: "num_episodes" int64, and float32
        "success_rate", "share_goal_a", "share_goal_b", "share_neither" (NaN when no episode ended).

    Raises:
        ShapeError: as :func:`mode_statistics`.
    """
    return _mode_counts(td["next", "goal_index"], td["next", "done"])


def _mode_counts(goal_index: Tensor, done: Tensor) -> TensorDict:
    if goal_index.shape != done.shape:
        raise ShapeError(f"goal_index shape {tuple(goal_index.shape)} and done shape {tuple(done.shape)}: expected equal")
    if done.dtype != torch.bool or goal_index.dtype.is_floating_point or goal_index.dtype == torch.bool:
        raise ShapeError(f"goal_index dtype {goal_index.dtype}, done dtype {done.dtype}: expected an integer and bool")
    ended = done.sum()
    a = (done & (goal_index == 0)).sum()
    b = (done & (goal_index == 1)).sum()
    total = ended.to(torch.float32)
    share_a, share_b = a / total, b / total
    return TensorDict(
        {
            "num_episodes": ended,
            "success_rate": share_a + share_b,
            "share_goal_a": share_a,
            "share_goal_b": share_b,
            "share_neither": (ended - a - b) / total,
        },
        batch_size=[],
        device=goal_index.device,
    )


def mode_statistics(goal_index: Tensor, done: Tensor) -> dict[str, float]:
    """Which goal the ended episodes reached: the two modes and failures.

    Args:
        goal_index: int64 of any shape, ("next", "goal_index") of a rollout: 0 g_a, 1 g_b, -1 none.
        done: bool, same shape, ("next", "done"); each True ends one episode.

    Returns:
        {"num_episodes": ended episodes, "success_rate", "share_goal_a", "share_goal_b",
        "share_neither"}; the shares are fractions of the ended episodes and sum to 1
        (success_rate = share_goal_a + share_goal_b); all NaN when no episode ended.

    Raises:
        ShapeError: the shapes differ, or ``done`` is not bool or ``goal_index`` not an integer type.
    """
    return {k: float(v) for k, v in _mode_counts(goal_index, done).items()}


# ---------------------------------------------------------------------------------------------
# Scripted expert and demonstrations.


def expert_action(observation: Tensor, goal_choice: Tensor, *, noise: Tensor | None = None, noise_std: float = 0.1) -> Tensor:
    """Straight to the chosen goal at full speed, slowing inside the last step so as not to overshoot.

    ``a = clip(v / max(|v|, STEP_LENGTH) + noise_std * noise, -1, 1)`` with ``v`` the vector to the
    chosen goal: a unit vector (1 m/s) until the goal is within one step, then exactly the step that
    lands on it.

    Args:
        observation: [N, 6] float, as :func:`observation`.
        goal_choice: [N] or [N, 1] int, 0 for g_a, any other value for g_b.
        noise: [N, 2] standard-normal noise, or None for none.
        noise_std: scale of ``noise``, >= 0.

    Returns:
        [N, 2] action in [-1, 1], dtype and device of ``observation``.

    Raises:
        ShapeError: ``observation`` is not [N, 6], or ``goal_choice`` / ``noise`` do not match N.
        ConfigError: ``noise_std < 0``.
    """
    if observation.ndim != 2 or observation.shape[-1] != OBS_DIM:
        raise ShapeError(f"observation shape {tuple(observation.shape)}: expected (N, {OBS_DIM})")
    n = observation.shape[0]
    if goal_choice.numel() != n or goal_choice.shape not in ((n,), (n, 1)):
        raise ShapeError(f"goal_choice shape {tuple(goal_choice.shape)}: expected ({n},) or ({n}, 1)")
    if noise_std < 0:
        raise ConfigError(f"noise_std={noise_std}: expected >= 0")
    choose_a = goal_choice.reshape(n, 1) == 0
    to_goal = torch.where(choose_a, observation[:, 2:4], observation[:, 4:6])
    dist = (to_goal * to_goal).sum(-1, keepdim=True).sqrt()
    action = to_goal / dist.clamp_min(STEP_LENGTH)
    if noise is not None:
        if noise.shape != (n, ACT_DIM):
            raise ShapeError(f"noise shape {tuple(noise.shape)}: expected ({n}, {ACT_DIM})")
        action = action + noise_std * noise
    return action.clamp(-1.0, 1.0)


def collect_demonstrations(
    num_episodes: int,
    horizon: int,
    *,
    generator: torch.Generator,
    device: torch.device | str | None = None,
    noise_std: float = 0.1,
) -> TensorDict:
    """Bimodal demonstrations: :func:`expert_action` episodes, each toward a goal picked by a fair coin.

    Args:
        num_episodes: E >= 1 episodes, run in parallel until success or MAX_STEPS.
        horizon: H >= 1, length of the action chunk stored with every step.
        generator: the only source of randomness (starts, coins, noise); on ``device``.
        device: where everything lives; ``None`` is the generator's device.
        noise_std: std of the Gaussian noise added to every expert action before clipping, >= 0.

    Returns:
        TensorDict with batch [M], M the total number of steps of all episodes, episode by episode
        in order: "observation" [M, 6] float32, "action" [M, H, 2] float32 (the executed actions of
        steps t .. t+H-1 of the episode, the last action repeated past its end), "goal_choice" [M]
        int64 (0: g_a, 1: g_b), "success" [M] bool (the episode reached a goal within MAX_STEPS),
        "episode" [M] int64 (0 .. E-1).

    Raises:
        ConfigError: ``num_episodes`` or ``horizon`` < 1, or ``noise_std < 0``.
    """
    _check_count("num_episodes", num_episodes, ConfigError)
    _check_count("horizon", horizon, ConfigError)
    if noise_std < 0:
        raise ConfigError(f"noise_std={noise_std}: expected >= 0")
    device = generator.device if device is None else torch.device(device)
    state = reset_state(num_episodes, generator, device)
    goal_choice = torch.randint(0, 2, (num_episodes,), generator=generator, device=device)
    obs = torch.empty(num_episodes, MAX_STEPS, OBS_DIM, device=device)
    act = torch.empty(num_episodes, MAX_STEPS, ACT_DIM, device=device)
    alive = torch.empty(num_episodes, MAX_STEPS, dtype=torch.bool, device=device)
    for t in range(MAX_STEPS):
        obs[:, t] = observation(state)
        noise = torch.randn(num_episodes, ACT_DIM, generator=generator, device=device) if noise_std > 0 else None
        act[:, t] = expert_action(obs[:, t], goal_choice, noise=noise, noise_std=noise_std)
        alive[:, t] = ~(state["terminated"] | state["truncated"]).squeeze(-1)
        state = step_state(state, act[:, t])[0]
    last = alive.sum(1, keepdim=True) - 1  # [E, 1] index of each episode's last step
    steps = torch.arange(MAX_STEPS, device=device).view(1, MAX_STEPS, 1) + torch.arange(horizon, device=device)
    index = torch.minimum(steps, last.unsqueeze(-1)).reshape(num_episodes, MAX_STEPS * horizon, 1)
    chunks = act.gather(1, index.expand(-1, -1, ACT_DIM)).reshape(num_episodes, MAX_STEPS, horizon, ACT_DIM)
    episode = torch.arange(num_episodes, device=device).unsqueeze(1).expand(-1, MAX_STEPS)
    m = alive.flatten()
    return TensorDict(
        {
            "observation": obs.flatten(0, 1)[m],
            "action": chunks.flatten(0, 1)[m],
            "goal_choice": goal_choice.unsqueeze(1).expand(-1, MAX_STEPS).flatten()[m],
            "success": state["terminated"].expand(-1, MAX_STEPS).flatten()[m],  # the episode reached a goal
            "episode": episode.flatten()[m],
        },
        batch_size=[int(m.sum())],
        device=device,
    )


# ---------------------------------------------------------------------------------------------
# TorchRL env.


class PointReachEnv(SplitEnv, EnvBase):
    """PointReach-v0 as a TorchRL ``EnvBase``: ``num_envs`` envs batched on ``device``.

    Keys: "observation" [N, 6] float32; "action" [N, 2] (``act_steps == 1``) or [N, act_steps, 2]
    float32 in [-1, 1]; ("next", "reward") [N, 1] float32; ("next", "done" | "terminated" |
    "truncated") [N, 1] bool; ("next", "success") [N, 1] bool and ("next", "goal_index") [N, 1] int64
    (0 g_a, 1 g_b, -1 none; both also in the reset output, False / -1 for a fresh episode).

    With ``act_steps > 1`` an action is a chunk executed open loop within one env step
    (Diffusion Policy's MultiStepWrapper): each env stops at its own episode end, the reward is the
    sum over the sub-steps it executed, and truncation counts sub-steps (at most
    ceil(MAX_STEPS / act_steps) env steps per episode).

    ``reset`` honours a partial "_reset" mask ([N] or [N, 1]), so ``env.rollout(T, policy,
    break_when_any_done=False)`` and TorchRL collectors auto-reset ended envs. An ended env that is
    stepped without reset is absorbing (reward 0, flags reported again). Randomness comes only from
    an internal ``torch.Generator`` on ``device``, seeded by ``seed`` / ``set_seed``.

    Args:
        num_envs: N >= 1.
        act_steps: env sub-steps per action, >= 1.
        device: a torch device or its name (None: cpu); fixed for the env's life.
        seed: seed of the generator; None draws a non-deterministic one.
        split: None, or (rank, world_size): these N envs are envs rank*N .. (rank+1)*N - 1 of the
            world_size*N envs of ``seed`` (every reset draws for all of them and keeps its rows, so
            the world_size envs of a data-parallel run together step the one env of a single process).
        any_done_of_split: with ``split``, ``fn(done_here: bool) -> bool``, whether an env of any rank
            of the split is done (a collective every rank calls once per step): TorchRL resets the envs
            after a step where one is done, and the single process's generator draws then, so a rank
            whose envs are not done draws too (a reset of none of them). None: the split's ranks
            draw only when one of their own envs is done (their generators drift apart then).

    Raises:
        EnvError: ``num_envs`` or ``act_steps`` is not an int >= 1, or ``split`` not (rank, world_size)
            with 0 <= rank < world_size.
    """

    max_episode_steps = MAX_STEPS  # sub-steps per episode at most (as gymnasium's spec; read by chunked evaluation)

    def __init__(self, num_envs: int = 1, *, act_steps: int = 1, device: torch.device | str | None = None, seed: int | None = None,
                 split: tuple[int, int] | None = None, any_done_of_split: Callable[[bool], bool] | None = None):
        _check_count("num_envs", num_envs)
        _check_count("act_steps", act_steps)
        self.set_split(split, any_done_of_split)
        device = torch.device("cpu") if device is None else torch.device(device)
        super().__init__(device=device, batch_size=torch.Size([num_envs]))
        self.num_envs = num_envs
        self.act_steps = act_steps
        self._generator = torch.Generator(device=device)
        n = num_envs
        self.observation_spec = Composite(
            observation=Unbounded(shape=(n, OBS_DIM), dtype=torch.float32, device=device),
            success=Categorical(2, shape=(n, 1), dtype=torch.bool, device=device),
            goal_index=Bounded(low=-1, high=1, shape=(n, 1), dtype=torch.int64, device=device),
            shape=(n,),
            device=device,
        )
        act_shape = (n, ACT_DIM) if act_steps == 1 else (n, act_steps, ACT_DIM)
        self.action_spec = Bounded(low=-1.0, high=1.0, shape=act_shape, dtype=torch.float32, device=device)
        self.reward_spec = Unbounded(shape=(n, 1), dtype=torch.float32, device=device)
        flag = Categorical(2, shape=(n, 1), dtype=torch.bool, device=device)
        self.done_spec = Composite(done=flag, terminated=flag.clone(), truncated=flag.clone(), shape=(n,), device=device)
        self._state = reset_state(n, self._generator, device)  # a placeholder until the first reset
        self.set_seed(seed)  # after it, so the first reset after construction or set_seed(s) agree

    @property
    def state(self) -> TensorDict:
        """The current :func:`reset_state`-style state, batch [N]: the live object, for inspection (do not modify)."""
        return self._state

    def set_state(self, state: TensorDictBase) -> TensorDict:
        """Replace the state of every env (e.g. copies of one start, for grouped rollouts).

        Args:
            state: a :func:`reset_state`-style TensorDict, batch [N], with the same keys, shapes and
                dtypes as :attr:`state`; it is copied (the caller's TensorDict is not kept).

        Returns:
            the output of a reset in that state ("observation", flags, "success", "goal_index").

        Raises:
            ShapeError: ``state`` has other keys or batch size, or another shape or dtype in a key.
        """
        if set(state.keys()) != set(self._state.keys()) or state.batch_size != self._state.batch_size:
            raise ShapeError(
                f"state: keys {sorted(state.keys())} and batch {tuple(state.batch_size)}, expected keys "
                f"{sorted(self._state.keys())} and batch {tuple(self._state.batch_size)}"
            )
        for key, value in self._state.items():
            if state[key].shape != value.shape or state[key].dtype != value.dtype:
                raise ShapeError(f"state[{key!r}]: shape {tuple(state[key].shape)} dtype {state[key].dtype}, "
                                 f"expected {tuple(value.shape)} {value.dtype}")
        self._state = state.to(self.device).clone()
        return self._output(self._state)

    def rng_state(self) -> Tensor:
        """The state of the env's generator (``torch.Generator.get_state``: a uint8 CPU tensor). With
        :attr:`state` it is all the env carries from one step to the next (what a snapshot saves)."""
        return self._generator.get_state()

    def set_rng_state(self, state: Tensor) -> None:
        """Put back a :meth:`rng_state` (the tensor may be on any device).

        Raises:
            EnvError: ``state`` is not a uint8 tensor. RuntimeError: it is not the state of a
                generator of this env's device type.
        """
        if not isinstance(state, Tensor) or state.dtype != torch.uint8:
            got = state.dtype if isinstance(state, Tensor) else type(state).__name__
            raise EnvError(f"state: {got}: expected the uint8 tensor of rng_state()")
        self._generator.set_state(state.cpu().clone())  # a fresh CPU tensor: set_state misreads offset views

    def _set_seed(self, seed: int | None) -> None:
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(int(seed))

    def _output(self, state: TensorDict, reward: Tensor | None = None) -> TensorDict:
        terminated, truncated, goal_index = state["terminated"], state["truncated"], state["goal_index"]
        out = {
            "observation": observation(state),
            "done": terminated | truncated,
            "terminated": terminated,
            "truncated": truncated,
            "success": goal_index >= 0,
            "goal_index": goal_index,
        }
        if reward is not None:
            out["reward"] = reward
        return TensorDict(out, batch_size=self.batch_size, device=self.device)

    def _reset(self, tensordict: TensorDictBase | None = None, **kwargs) -> TensorDict:
        mask = None if tensordict is None else tensordict.get("_reset", None)
        rank, world_size = self._split
        fresh = reset_state(self.num_envs * world_size, self._generator, self.device)  # for every env of the split
        if world_size > 1:
            fresh = fresh[rank * self.num_envs : (rank + 1) * self.num_envs]
        self._state = fresh if mask is None else _reset_where(self._state, mask.reshape(self.num_envs), fresh)
        return self._output(self._state)

    def _step(self, tensordict: TensorDictBase) -> TensorDict:
        action = tensordict["action"]
        if self.act_steps == 1:
            self._state, reward, *_ = step_state(self._state, action)
        else:
            reward = torch.zeros(self.num_envs, 1, device=self.device)
            for k in range(self.act_steps):
                self._state, r, *_ = step_state(self._state, action[:, k])
                reward = reward + r
        return self._output(self._state, reward)


# ---------------------------------------------------------------------------------------------
# Gymnasium env.


class PointReachGymEnv(gym.Env):
    """PointReach-v0 as a single numpy gymnasium env (float32), same dynamics and constants.

    Registered by ``import envs`` as ``"PointReach-v0"`` with ``max_episode_steps=MAX_STEPS``: the
    env itself only terminates (on success), gymnasium's TimeLimit truncates. Observation Box [6]
    float32 (unbounded), action Box [2] float32 in [-1, 1]; ``info`` has "success" (bool) and
    "goal_index" (int: 0 g_a, 1 g_b, -1 none).

    ``state`` (float32 [8]: position, g_a, g_b, start) holds the whole episode and randomness comes
    from ``self.np_random`` only, so ``rlfunc.envs.collect.env_state`` / ``set_env_state`` restore it.
    """

    metadata = {"render_modes": []}

    def __init__(self, render_mode: str | None = None):
        if render_mode is not None:
            raise EnvError(f"render_mode={render_mode!r}: PointReach-v0 does not render")
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, shape=(OBS_DIM,), dtype=np.float32)
        self.action_space = gym.spaces.Box(-1.0, 1.0, shape=(ACT_DIM,), dtype=np.float32)
        self.state = np.zeros(_STATE_DIM, dtype=np.float32)

    def _obs(self) -> np.ndarray:
        p, goals = self.state[0:2], self.state[2:6].reshape(2, 2)
        return np.concatenate([p, goals[0] - p, goals[1] - p]).astype(np.float32)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        start = (self.np_random.uniform(-1.0, 1.0, size=2) * START_RANGE).astype(np.float32)
        theta = self.np_random.uniform(0.0, 2.0 * math.pi)
        axis = (GOAL_DISTANCE * np.array([math.cos(theta), math.sin(theta)])).astype(np.float32)
        self.state = np.concatenate([start, start + axis, start - axis, start]).astype(np.float32)
        return self._obs(), {"success": False, "is_success": False, "goal_index": -1}

    def step(self, action):
        a = np.clip(np.nan_to_num(np.asarray(action, dtype=np.float32).reshape(ACT_DIM), nan=0.0), -1.0, 1.0)
        p, goals = self.state[0:2], self.state[2:6].reshape(2, 2)
        new_p = p + np.float32(STEP_LENGTH) * a
        before = np.sqrt(_np_goal_sq_distance(goals, p).min())
        dist_sq = _np_goal_sq_distance(goals, new_p)
        after = np.sqrt(dist_sq.min())
        success = bool(dist_sq.min() <= np.float32(SUCCESS_RADIUS**2))
        reward = (before - after) + np.float32(SUCCESS_BONUS if success else 0.0) - np.float32(STEP_PENALTY)
        self.state = np.concatenate([new_p, self.state[2:]]).astype(np.float32)
        goal_index = int(np.argmin(dist_sq)) if success else -1
        # "is_success": gymnasium's key, which rlfunc's evaluations read (success_rate); "success": kept for old callers
        return self._obs(), float(reward), success, False, {"success": success, "is_success": success, "goal_index": goal_index}


def _np_goal_sq_distance(goals: np.ndarray, position: np.ndarray) -> np.ndarray:
    d = goals - position[None, :]
    return (d * d).sum(-1)
