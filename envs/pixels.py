"""Pixel observations for gymnasium's MuJoCo envs: :class:`PixelObservation` and PusherPixels-v5.

:class:`PixelObservation` wraps a MuJoCo gymnasium env (one with ``unwrapped.model`` and
``unwrapped.data``, e.g. Pusher-v5) and replaces its observation by a Dict:

- one uint8 ``[size, size, 3]`` RGB image per :class:`CameraView`, rendered with ``mujoco.Renderer``
  from a free camera (``mujoco.MjvCamera``: look-at point, distance, azimuth, elevation), so the model
  needs no named cameras;
- "proprio": float32 ``[D]``, the wrapped env's own state vector (Pusher-v5: 23 numbers, joint angles
  and velocities, fingertip, object and goal positions).

The Dict is what :func:`rlfunc.algos.diffusion_actor.env_info` reads (cameras + "proprio"), so the
multimodal encoder and the encoder PPO (:mod:`rlfunc.algos.ppo_encoder`) take it as they take Push-v0.

PusherPixels-v5 (registered in ``envs/__init__.py``, 100-step time limit as Pusher-v5): Pusher-v5 with
:data:`PUSHER_VIEWS`, a top-down view of the table and a 45-degree view from the side opposite the
arm, 128 x 128 px. Rewards, actions, termination and truncation are Pusher-v5's, untouched.

Headless rendering: importing this module imports :mod:`envs.push.env` first, which sets
``MUJOCO_GL`` (egl, else osmesa) before mujoco is imported and builds renderers through its
``_make_renderer`` (an :class:`rlfunc.errors.EnvError` naming what to install when no OpenGL works).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from envs.push import env as _push  # sets MUJOCO_GL before mujoco is imported; renderer helpers

import gymnasium as gym  # noqa: E402
import mujoco  # noqa: E402
import numpy as np  # noqa: E402

from rlfunc.errors import EnvError  # noqa: E402

IMAGE_SIZE = 128  # px, side of every camera image


@dataclass(frozen=True)
class CameraView:
    """A free camera: it looks at ``lookat`` (m, world frame) from ``distance`` (m), turned by
    ``azimuth`` (degrees about the world z axis) and ``elevation`` (degrees; -90 looks straight down)."""

    name: str
    lookat: tuple[float, float, float]
    distance: float
    azimuth: float
    elevation: float

    def camera(self) -> mujoco.MjvCamera:
        cam = mujoco.MjvCamera()
        cam.type = mujoco.mjtCamera.mjCAMERA_FREE
        cam.lookat[:] = self.lookat
        cam.distance, cam.azimuth, cam.elevation = self.distance, self.azimuth, self.elevation
        return cam


# Pusher-v5: the table top is the plane z = -0.325, the arm's base at (0, -0.6, 0), the object starts
# near (0.45, -0.05) +- 0.2 m and the goal sits at (0.45, -0.05); both views frame arm, object and goal.
PUSHER_VIEWS = (
    CameraView("top", lookat=(0.35, -0.2, -0.325), distance=1.6, azimuth=90.0, elevation=-90.0),
    CameraView("side", lookat=(0.35, -0.2, -0.325), distance=1.7, azimuth=0.0, elevation=-45.0),
)


class PixelObservation(gym.ObservationWrapper):
    """``env``'s observation -> {view.name: uint8 [size, size, 3], "proprio": float32 [D]}.

    Args:
        env: a MuJoCo gymnasium env (``env.unwrapped`` has ``model`` and ``data``) with a 1-D Box
            observation (its state vector, which becomes "proprio").
        views: the cameras, distinct names other than "proprio".
        size: image side in px, >= 32 (the encoder's minimum).

    Raises:
        EnvError: an env without a MuJoCo model, a non-1-D-Box observation, bad ``views`` or ``size``;
            on reset/step, no working OpenGL.
    """

    def __init__(self, env: gym.Env, views: Sequence[CameraView], size: int = IMAGE_SIZE) -> None:
        super().__init__(env)
        base = env.unwrapped
        if not isinstance(getattr(base, "model", None), mujoco.MjModel) or not isinstance(getattr(base, "data", None), mujoco.MjData):
            raise EnvError(f"env={env}: expected a MuJoCo env (unwrapped.model / unwrapped.data), for PixelObservation")
        space = env.observation_space
        if not isinstance(space, gym.spaces.Box) or len(space.shape) != 1:
            raise EnvError(f"env={env}: observation space {space}: expected a 1-D Box (the state vector, kept as 'proprio')")
        names = [v.name for v in views]
        if not names or len(set(names)) != len(names) or "proprio" in names:
            raise EnvError(f"views={names}: expected one or more distinct camera names other than 'proprio'")
        if isinstance(size, bool) or not isinstance(size, int) or size < 32:
            raise EnvError(f"size={size!r}: expected an int >= 32 (px)")
        self.views, self.size = tuple(views), size
        self._cameras = [v.camera() for v in self.views]
        self._renderer: mujoco.Renderer | None = None
        image = gym.spaces.Box(0, 255, shape=(size, size, 3), dtype=np.uint8)
        proprio = gym.spaces.Box(-np.inf, np.inf, shape=space.shape, dtype=np.float32)
        self.observation_space = gym.spaces.Dict({**{n: image for n in names}, "proprio": proprio})

    def observation(self, observation: np.ndarray) -> dict[str, np.ndarray]:
        if self._renderer is None:
            vis = self.env.unwrapped.model.vis
            vis.global_.offwidth, vis.global_.offheight = max(vis.global_.offwidth, self.size), max(vis.global_.offheight, self.size)
            # no shadow map, no multisampling: software GL (llvmpipe) renders Pusher ~10x faster (as push.xml)
            vis.quality.shadowsize, vis.quality.offsamples = 0, 0
            self._renderer = _push._make_renderer(self.env.unwrapped.model, self.size)
            _push.PushEnv._register_renderers(self)  # freed before the GL display at exit, as Push-v0's
        data = self.env.unwrapped.data
        out = {}
        for view, cam in zip(self.views, self._cameras):
            self._renderer.update_scene(data, camera=cam)
            out[view.name] = self._renderer.render()  # a fresh array per call
        out["proprio"] = np.asarray(observation, dtype=np.float32)
        return out

    def _close_renderers(self) -> None:
        if self._renderer is not None:
            self._renderer.close()
            self._renderer = None

    def close(self) -> None:
        self._close_renderers()
        super().close()


def make_pusher_pixels(size: int = IMAGE_SIZE, **kwargs) -> PixelObservation:
    """PusherPixels-v5's entry point: gymnasium's Pusher-v5 env (``kwargs`` go to it) with
    :data:`PUSHER_VIEWS` at ``size`` px."""
    from gymnasium.envs.mujoco.pusher_v5 import PusherEnv

    return PixelObservation(PusherEnv(**kwargs), PUSHER_VIEWS, size)
