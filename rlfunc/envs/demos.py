"""Expert demonstrations as a diffusion-BC dataset: observations with the action chunk that follows.

Each step t of an episode of length L becomes one sample: the observation o_t (the keys the actor's
env gives, see :mod:`rlfunc.envs.chunk`) and the chunk a_t .. a_{t+H-1} of the expert's actions in
[-1, 1] (scaled from the action space's bounds), the last action repeated past the episode's end
(Chi et al. 2023, "Diffusion Policy", edge padding of the action sequence).

The experts are the env registry's (:attr:`rlfunc.envs.registry.EnvEntry.demonstrations`): an env
with a torch-batched expert builds the dataset itself; one whose expert plays gymnasium episodes hands
them to :func:`gym_demonstrations`, which encodes them here.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from tensordict import TensorDict

from rlfunc.envs import registry
from rlfunc.errors import EnvError


def check_expert(env_id: str) -> None:
    """EnvError unless ``env_id`` has a scripted expert in the env registry (the message lists those that do)."""
    entry = registry.find(env_id)
    if entry is None or entry.demonstrations is None:
        experts = ", ".join(registry.ids("demonstrations"))
        raise EnvError(f"env={env_id!r}: no scripted expert to learn from; bc runs on {experts}")


def chunk_indices(length: int, horizon: int) -> np.ndarray:
    """int64 ``[length, horizon]``: row t = t, t+1, ..., t+H-1, clipped to ``length - 1``."""
    return np.minimum(np.arange(length)[:, None] + np.arange(horizon)[None, :], length - 1)


def expert_demonstrations(
    env_id: str, num_episodes: int, horizon: int, *, seed: int, noise_std: float, device: torch.device
) -> tuple[TensorDict, dict]:
    """The scripted expert's episodes of ``env_id`` as a BC dataset.

    Args:
        env_id: an id with a scripted expert in the env registry (``registry.ids("demonstrations")``).
        num_episodes: E >= 1 expert episodes.
        horizon: H >= 1, the chunk length stored with every step.
        seed: seed of the episodes (resets, route coins, noise).
        noise_std: std of the noise on the executed actions, in [-1, 1] action units (the expert says
            whether the noisy action or, DART-style, the clean one is recorded).
        device: where the dataset lives (images stay uint8).

    Returns:
        (dataset, summary): TensorDict [M] (M = total steps) with the env's observation keys,
        "action" float32 [M, H, A] in [-1, 1] and "episode" int64 [M]; summary {"success_rate",
        "num_episodes", "num_samples"} of the expert's episodes.

    Raises:
        EnvError: ``env_id`` has no scripted expert.
    """
    check_expert(env_id)
    return registry.lookup(env_id).demonstrations(env_id, num_episodes, horizon, seed=seed, noise_std=noise_std, device=device)


def gym_demonstrations(
    env_id: str, expert: Callable[..., dict], num_episodes: int, horizon: int, *, seed: int, noise_std: float,
    device: torch.device,
) -> tuple[TensorDict, dict]:
    """:func:`expert_demonstrations` for an expert that plays gymnasium episodes of ``env_id``.

    Args:
        expert: ``expert(env_id, num_episodes, seed, noise_std=...)`` -> {"episodes": [{"observations":
            [L + 1] gymnasium observations, "actions": [L, A] in the action space's units}], "success_rate"};
            its ``noise_std`` is in action-space units (``noise_std`` times half the action range).
        the others: as :func:`expert_demonstrations`.

    Returns:
        As :func:`expert_demonstrations`, with the expert's "success_rate" in the summary.
    """
    from rlfunc.envs.chunk import ObservationCodec, action_bounds, env_instructions, unscale_action
    from rlfunc.envs.collect import make_env

    env = make_env(env_id)
    codec = ObservationCodec(env.observation_space, env_id, env_instructions(env_id))
    low, high = action_bounds(env.action_space, env_id)
    env.close()
    result = expert(env_id, num_episodes, seed, noise_std=noise_std * float(high[0] - low[0]) / 2.0)
    parts = []
    for i, ep in enumerate(result["episodes"]):
        length = len(ep["actions"])
        obs = ep["observations"][:length]
        fields = codec.encode(list(obs), device)
        actions = unscale_action(ep["actions"], low, high)[chunk_indices(length, horizon)]
        fields["action"] = torch.from_numpy(np.ascontiguousarray(actions, np.float32)).to(device)
        fields["episode"] = torch.full((length,), i, dtype=torch.int64, device=device)
        parts.append(TensorDict(fields, batch_size=[length], device=device))
    data = torch.cat(parts)
    summary = {"num_episodes": num_episodes, "num_samples": data.batch_size[0], "success_rate": result["success_rate"]}
    return data, summary
