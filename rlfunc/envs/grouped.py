"""Grouped rollouts: G episodes that start from the same state, for group-relative advantages (GRPO).

The n_groups * G envs of a batch are laid out group by group (env ``g * G + k`` is member k of group
g). Members of a group start identical and then diverge through the policy's own sampling (and the
env's, if it is stochastic). Each env contributes its first episode only, up to ``max_steps`` steps;
steps after it ends are padding, marked False in "mask".

Two sources of envs:

- :func:`grouped_rollout_gym`: a gymnasium vector env (``rlfunc.envs.collect.make_vec_env``) whose G
  members of group g are reset with the same seed ``seeds[g]``;
- :func:`grouped_rollout_torchrl`: a torch-batched TorchRL ``EnvBase`` exposing ``state`` and
  ``set_state(state)`` (e.g. ``envs.point_reach.PointReachEnv``): one reset, then the first member's
  state of each group copied to the other G - 1.

Both return a TensorDict with batch [n_groups, G, T] and TorchRL's keys ("observation", "action",
"sample_log_prob", ("next", "reward" | "done" | "terminated" | "truncated" | "observation")), plus
"mask" [n_groups, G, T, 1] bool, True on the steps of each env's first episode.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import gymnasium as gym
import torch
from tensordict import TensorDict, TensorDictBase
from torch import Tensor

from rlfunc.envs import collect
from rlfunc.errors import ConfigError, EnvError, ShapeError


def first_episode_mask(done: Tensor, *, time_dim: int = -2) -> Tensor:
    """True on the steps of the first episode: step t is valid iff no step before t is done.

    Args:
        done: [*B, T, *F] bool (or 0/1 numbers), ("next", "done") of a rollout.
        time_dim: the time dimension.

    Returns:
        [*B, T, *F] bool; the step that ends the episode is valid, the ones after it are not.
    """
    d = (done != 0).to(torch.int32)
    return (d.cumsum(time_dim) - d) == 0


def sequence_return(batch: TensorDictBase) -> Tensor:
    """Undiscounted return of each sequence of a grouped batch: sum of ("next", "reward") over "mask".

    Args:
        batch: batch [*B, T] with ("next", "reward") and "mask", both [*B, T, 1].

    Returns:
        [*B] float (env reward units); NaN if a valid step's reward is NaN.
    """
    reward, mask = batch["next", "reward"], batch["mask"]
    return torch.where(mask, reward, torch.zeros_like(reward)).sum((-2, -1))


def _check_sizes(num_envs: int, group_size: int, max_steps: int) -> int:
    for name, value in (("group_size", group_size), ("max_steps", max_steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name}={value!r}: expected an int >= 1")
    if num_envs % group_size:
        raise EnvError(f"the env has {num_envs} envs, not a multiple of group_size={group_size}")
    return num_envs // group_size


def grouped_rollout_gym(
    venv: gym.vector.VectorEnv,
    policy: collect.Policy,
    seeds: Sequence[int],
    group_size: int,
    max_steps: int,
    *,
    device: torch.device,
) -> TensorDict:
    """One episode per env of ``venv``, the G members of group g reset with the seed ``seeds[g]``.

    Args:
        venv: a gymnasium vector env with SAME_STEP autoreset (:func:`rlfunc.envs.collect.make_vec_env`)
            of ``len(seeds) * group_size`` envs, Box observations and actions.
        policy: ``observation [N, obs_dim] -> (action [N, act_dim], sample_log_prob [N, 1])``, as for
            :func:`rlfunc.envs.collect.rollout` (randomness inside it, e.g. a seeded generator).
        seeds: n_groups reset seeds, one per group (a seed fixes the start state of a gymnasium env).
        group_size: G >= 1.
        max_steps: T >= 1, steps taken by every env; an episode longer than T is cut at T (its
            "mask" is True to the end and its return is partial). Use the env's time limit.
        device: where the batch goes.

    Returns:
        TensorDict, batch [n_groups, G, T], on ``device``, keys as in the module docstring
        (observations flattened to obs_dim).

    Raises:
        EnvError: ``venv.num_envs != len(seeds) * group_size``.
        ConfigError: ``group_size`` or ``max_steps`` is not an int >= 1.
    """
    n_groups = _check_sizes(venv.num_envs, group_size, max_steps)
    if len(seeds) != n_groups:
        raise EnvError(f"seeds has {len(seeds)} entries; the env has {venv.num_envs} envs = {n_groups} groups "
                       f"of group_size={group_size}: expected one seed per group")
    member_seeds = [int(s) for s in seeds for _ in range(group_size)]
    carry = collect.reset(venv, member_seeds)
    batch, _ = collect.rollout(venv, policy, carry, max_steps, device=device)
    batch["mask"] = first_episode_mask(batch["next", "done"])
    return batch.reshape(n_groups, group_size, max_steps)


def grouped_reset(env, group_size: int) -> TensorDict:
    """Reset a torch-batched env so that the G members of every group share one start state.

    Resets all N envs (one draw of the env's generator), then copies the state of the first member
    of each group to the other members with ``env.set_state``.

    Args:
        env: a TorchRL ``EnvBase`` with batch [N], N a multiple of ``group_size``, exposing ``state``
            (a TensorDict with batch [N]) and ``set_state(state) -> reset output``.
        group_size: G >= 1.

    Returns:
        the reset TensorDict, batch [N], as ``env.reset()`` returns it.

    Raises:
        EnvError: N is not a multiple of G, or the env has no ``state`` / ``set_state``.
    """
    n = env.batch_size[0] if len(env.batch_size) else 1
    n_groups = _check_sizes(n, group_size, 1)
    if not (hasattr(env, "state") and callable(getattr(env, "set_state", None))):
        raise EnvError(f"{type(env).__name__} has no state / set_state(state): grouped resets need both")
    env.reset()
    first = env.state[torch.arange(n_groups, device=env.device) * group_size]
    return env.set_state(first.repeat_interleave(group_size, dim=0))


def grouped_rollout_torchrl(env, policy: collect.Policy, group_size: int, max_steps: int,
                            longest: Callable[[int], int] | None = None) -> TensorDict:
    """One episode per env of a torch-batched TorchRL env, G members per group from one start state.

    Args:
        env: as for :func:`grouped_reset`; envs that have ended are stepped on with the others
            (PointReachEnv makes them absorbing) and their steps are masked out.
        policy: ``observation [N, obs_dim] -> (action, sample_log_prob [N, 1])`` on the env's device.
        group_size: G >= 1.
        max_steps: T >= 1; the rollout stops earlier once every env's first episode has ended.
        longest: None, or, for ``env`` one rank's split of a data-parallel run's env (its ``split=``),
            ``fn(steps) -> steps`` the most steps any rank's rollout took (a collective every rank
            calls once per rollout). A rank whose episodes all ended sooner then calls ``policy``
            once per missing step (the single process's policy draws for every env at every step)
            and repeats its last step, as TorchRL's rollout does for the ended envs of a batch that
            goes on: the rows are the single process's when ended envs are absorbing (PointReachEnv's are).

    Returns:
        TensorDict, batch [n_groups, G, T'] with T' <= ``max_steps`` the steps taken, on the env's
        device, keys as in the module docstring.

    Raises:
        EnvError, ConfigError: as :func:`grouped_reset`, or ``max_steps`` < 1.
    """
    n = env.batch_size[0] if len(env.batch_size) else 1
    n_groups = _check_sizes(n, group_size, max_steps)
    start = grouped_reset(env, group_size)
    td = env.rollout(
        max_steps, collect.policy_module(policy), auto_reset=False, tensordict=start,
        break_when_any_done=False, break_when_all_done=True,
    )
    if td.batch_size[:1] != (n,):
        raise ShapeError(f"env.rollout returned batch {tuple(td.batch_size)}, expected ({n}, T)")
    if longest is not None:
        missing = longest(td.batch_size[1]) - td.batch_size[1]
        last = td[:, -1:]
        with torch.no_grad():
            for _ in range(missing):  # the draws of the steps the others took; the actions are not kept
                policy(last["next", "observation"].reshape(n, -1))
        if missing:
            td = torch.cat([td, *[last] * missing], dim=1)
    td["mask"] = first_episode_mask(td["next", "done"])
    return td.reshape(n_groups, group_size, td.batch_size[1])
