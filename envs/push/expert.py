"""A scripted expert for Push-v0 / PushState-v0, with two routes round the block, and demonstrations.

The expert reads the true state (paddle centre ``ee``, block centre ``b``, target ``g``, all from the
unwrapped env) and works in the block's frame: ``u = (g - b) / |g - b|`` the push direction,
``n`` = ``u`` turned +90 degrees, and the paddle's offset ``rel = ee_xy - b`` split into
``along = rel . u`` and ``lateral = rel . n``. The paddle is *behind* the block when
``along < -BEHIND``; then it pushes: ``v = V_push u - K_LAT lateral n`` with ``V_push`` slowing
near the target. Otherwise it circles the block at radius ``ORBIT_RADIUS`` on the side its route
says, "left" (through ``lateral > 0``, counter-clockwise seen from above) or "right", until it is
behind. The height is held at the bottom of the env's clamp band (pushing height).

Routes: at the start of an episode, :func:`choose_route` tosses a fair coin between "left" and "right"
when the paddle is not behind the block (the usual case: it starts between the arm and the block),
and says "direct" when it is already behind. So demonstrations reach the block's back by two
distinct routes, a bimodal behaviour for multimodal policies.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np

from rlfunc.errors import ConfigError, EnvError

ROUTES = ("left", "right", "direct")
BEHIND = 0.05  # m, the paddle is behind the block when its offset along the push direction is below -BEHIND
PUSH_LINE = 0.012  # m, lateral offset from the push line within which the paddle pushes (else it realigns)
ORBIT_RADIUS = 0.10  # m, radius of the circle round the block's centre
APPROACH = 0.085  # m, distance behind the block's centre of the approach point
ORBIT_SPEED = 0.22  # m/s
APPROACH_SPEED = 0.18  # m/s
PUSH_SPEED = 0.12  # m/s, far from the target
PUSH_GAIN = 1.5  # 1/s, the push speed is clip(PUSH_GAIN * |g - b|, PUSH_MIN, PUSH_SPEED)
PUSH_MIN = 0.04  # m/s
K_LAT = 4.0  # 1/s, lateral correction gain while pushing
K_RADIAL = 4.0  # 1/s, radial correction gain while circling
K_Z = 5.0  # 1/s, height gain


def _frame(env_unwrapped) -> tuple[np.ndarray, np.ndarray, np.ndarray, float, float, float]:
    """(u, n, rel, along, lateral, |g - b|) of the current state."""
    ee = env_unwrapped.ee_position
    b, g = env_unwrapped.block_position, env_unwrapped.target_position
    to_goal = g - b
    dist = float(np.linalg.norm(to_goal))
    u = to_goal / max(dist, 1e-9)
    n = np.array([-u[1], u[0]])
    rel = ee[:2] - b
    return u, n, rel, float(rel @ u), float(rel @ n), dist


def choose_route(env_unwrapped, rng: np.random.Generator) -> str:
    """The episode's route: "direct" if the paddle is already behind the block, else a fair coin
    between "left" and "right" (one draw from ``rng`` in that case only)."""
    _, _, _, along, _, _ = _frame(env_unwrapped)
    if along < -BEHIND:
        return "direct"
    return "left" if rng.random() < 0.5 else "right"


def expert_action(env_unwrapped, route: str) -> np.ndarray:
    """The expert's paddle velocity for the current state.

    Args:
        env_unwrapped: a reset ``envs.push.env.PushEnv`` (or PushStateEnv), e.g. ``env.unwrapped``.
        route: "left", "right" or "direct" (as :func:`choose_route`); "direct" circles on the nearer
            side if the paddle has to go round the block.

    Returns:
        [3] float32 action (vx, vy, vz), m/s, within the env's action bounds.

    Raises:
        ConfigError: an unknown ``route``.
    """
    from envs.push.env import EE_Z_RANGE, MAX_EE_SPEED

    if route not in ROUTES:
        raise ConfigError(f"route={route!r}: expected one of {ROUTES}")
    u, n, rel, along, lateral, dist = _frame(env_unwrapped)
    if along < -BEHIND:
        if abs(lateral) <= PUSH_LINE:
            speed = float(np.clip(PUSH_GAIN * dist, PUSH_MIN, PUSH_SPEED))
            v_xy = speed * u - K_LAT * lateral * n
        else:  # behind but off the line: to the approach point, without touching the block
            to_point = -APPROACH * u - rel
            v_xy = APPROACH_SPEED * to_point / max(np.linalg.norm(to_point), APPROACH_SPEED / K_LAT)
    else:
        side = {"left": 1.0, "right": -1.0}.get(route, 1.0 if lateral >= 0 else -1.0)
        r = float(np.linalg.norm(rel))
        radial = rel / max(r, 1e-9)
        tangent = side * np.array([-radial[1], radial[0]])
        v_xy = ORBIT_SPEED * tangent + K_RADIAL * (ORBIT_RADIUS - r) * radial
    v_z = K_Z * (EE_Z_RANGE[0] - env_unwrapped.ee_position[2])
    return np.clip(np.array([*v_xy, v_z]), -MAX_EE_SPEED, MAX_EE_SPEED).astype(np.float32)


def collect_demonstrations(
    env_id: str = "PushState-v0",
    num_episodes: int = 50,
    seed: int = 0,
    *,
    video_path: str | Path | None = None,
    video_episodes: int = 1,
    noise_std: float = 0.0,
) -> dict[str, Any]:
    """Scripted-expert episodes, each with a route chosen by :func:`choose_route`.

    Args:
        env_id: "PushState-v0" or "Push-v0" (any id whose unwrapped env is a PushEnv).
        num_episodes: E >= 1 episodes; episode i is reset with seed ``seed + i``, and the route coins
            come from ``numpy.random.default_rng(seed)``.
        seed: the base seed.
        video_path: if given and imageio is installed, the first ``video_episodes`` episodes are
            written there as one MP4 (or GIF, by the suffix) of the side camera at 10 fps, through
            ``render_mode="rgb_array"``; without imageio (or, for .mp4, imageio-ffmpeg) it is skipped
            with a warning and the result's "video" is None. Needs a working OpenGL (else EnvError).
        video_episodes: how many episodes go into the video.
        noise_std: std of Gaussian noise, in m/s, added to the executed action (then clipped to the
            action bounds); the recorded action is the expert's clean one at the visited state, so
            the data covers small deviations and says how to recover (DART, Laskey et al. 2017).
            The noise comes from ``numpy.random.default_rng([seed, 1])`` (0: the noise-free run).

    Returns:
        dict: "episodes", a list of E dicts, each with "observations" (the T + 1 observations as the
        env gives them: a float32 [T + 1, 21] array for PushState-v0, a list of dicts for Push-v0),
        "actions" float32 [T, 3], "rewards" float32 [T], "terminated" and "truncated" bool [T],
        "is_success" bool (the last step's), "route" str, "seed" int; and the summaries "route"
        (array of E str), "is_success" bool [E], "length" int64 [E], "success_rate" float,
        "route_share" {route: fraction of episodes}, "video" (the path written, or None).

    Raises:
        ConfigError: ``num_episodes`` < 1.
        EnvError: ``env_id`` is not a Push env.
    """
    import envs  # noqa: F401  (registers the Push envs)
    from envs.push.env import MAX_EE_SPEED, PushEnv

    if isinstance(num_episodes, bool) or not isinstance(num_episodes, int) or num_episodes < 1:
        raise ConfigError(f"num_episodes={num_episodes!r}: expected an int >= 1")
    if not noise_std >= 0:
        raise ConfigError(f"noise_std={noise_std!r}: expected >= 0")
    noise_rng = np.random.default_rng([seed, 1])
    writer = _video_writer(video_path) if video_path is not None else None
    env = gym.make(env_id, render_mode="rgb_array" if writer is not None else None)
    if not isinstance(env.unwrapped, PushEnv):
        env.close()
        raise EnvError(f"env_id={env_id!r}: expected a Push env (Push-v0, PushState-v0)")
    rng = np.random.default_rng(seed)
    episodes = []
    try:
        for i in range(num_episodes):
            obs, _ = env.reset(seed=seed + i)
            u = env.unwrapped
            route = choose_route(u, rng)
            record = writer is not None and i < video_episodes
            observations, actions, rewards, terms, truncs = [obs], [], [], [], []
            success = False
            if record:
                writer.append_data(env.render())
            while True:
                action = expert_action(u, route)
                executed = action
                if noise_std > 0:
                    executed = np.clip(action + noise_std * noise_rng.standard_normal(3), -MAX_EE_SPEED, MAX_EE_SPEED)
                obs, reward, term, trunc, info = env.step(executed.astype(np.float32))
                observations.append(obs)
                actions.append(action)
                rewards.append(reward)
                terms.append(term)
                truncs.append(trunc)
                success = bool(info["is_success"])
                if record:
                    writer.append_data(env.render())
                if term or trunc:
                    break
            episodes.append(
                {
                    "observations": np.stack(observations) if isinstance(obs, np.ndarray) else observations,
                    "actions": np.stack(actions).astype(np.float32),
                    "rewards": np.asarray(rewards, np.float32),
                    "terminated": np.asarray(terms, bool),
                    "truncated": np.asarray(truncs, bool),
                    "is_success": success,
                    "route": route,
                    "seed": seed + i,
                }
            )
    finally:
        env.close()
        if writer is not None:
            writer.close()
    routes = np.array([ep["route"] for ep in episodes])
    is_success = np.array([ep["is_success"] for ep in episodes])
    return {
        "episodes": episodes,
        "route": routes,
        "is_success": is_success,
        "length": np.array([len(ep["actions"]) for ep in episodes], np.int64),
        "success_rate": float(is_success.mean()),
        "route_share": {r: float((routes == r).mean()) for r in ROUTES},
        "video": None if writer is None else str(video_path),
    }


def _video_writer(path: str | Path):
    """An imageio writer at 10 fps, or None (with a warning, nothing written) if imageio or its plugin is missing."""
    try:
        import imageio.v2 as imageio
    except ImportError:
        warnings.warn(f"video {path} skipped: imageio is not installed (pip install imageio)", stacklevel=3)
        return None
    try:
        return imageio.get_writer(str(path), fps=10)
    except Exception as e:  # imageio raises ValueError / ImportError / RuntimeError when the format's plugin is missing
        hint = " (pip install imageio-ffmpeg, or write a .gif)" if str(path).endswith(".mp4") else ""
        warnings.warn(f"video {path} skipped: imageio cannot write it: {type(e).__name__}{hint}", stacklevel=3)
        return None
