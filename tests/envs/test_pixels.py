"""envs.pixels: PusherPixels-v5 (Pusher-v5 rendered from two free cameras + its state as proprio).

Tests that render skip when no OpenGL works (as tests/envs/test_push.py)."""

import subprocess
import sys
import warnings

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import envs  # noqa: F401  (registers PusherPixels-v5)
from envs.push import env as pe
from rlfunc.errors import EnvError

pixels = pytest.importorskip("envs.pixels")


def _rendering_available() -> bool:
    try:
        env = gym.make("PusherPixels-v5")
        env.reset(seed=0)
        env.close()
        return True
    except EnvError:
        return False


RENDERING = _rendering_available()
needs_rendering = pytest.mark.skipif(not RENDERING, reason=f"no working OpenGL (backend {pe.gl_backend()})")


def _wrapper(env: gym.Env) -> "pixels.PixelObservation":
    while not isinstance(env, pixels.PixelObservation):
        env = env.env
    return env


def test_registration_is_light_and_matches_pusher():
    code = "import sys, envs; assert 'mujoco' not in sys.modules and 'envs.pixels' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
    spec = gym.spec("PusherPixels-v5")
    assert spec.max_episode_steps == gym.spec("Pusher-v5").max_episode_steps == 100


@needs_rendering
def test_observation_shapes_dtypes_and_proprio_is_the_state():
    env = gym.make("PusherPixels-v5")
    ref = gym.make("Pusher-v5")
    try:
        obs, _ = env.reset(seed=3)
        state, _ = ref.reset(seed=3)
        assert set(obs) == {"top", "side", "proprio"}
        for cam in ("top", "side"):
            assert obs[cam].shape == (128, 128, 3) and obs[cam].dtype == np.uint8
            assert obs[cam].std() > 5  # a scene, not a blank frame
        assert obs["proprio"].dtype == np.float32 and obs["proprio"].shape == (23,)
        np.testing.assert_allclose(obs["proprio"], state.astype(np.float32))
        assert env.observation_space.contains(obs)
        action = np.full(7, 0.5, np.float32)
        obs2, r, *_ = env.step(action)
        state2, r_ref, *_ = ref.step(action)
        np.testing.assert_allclose(obs2["proprio"], state2.astype(np.float32), rtol=1e-6)
        assert r == pytest.approx(r_ref)
    finally:
        env.close()
        ref.close()


@needs_rendering
def test_images_change_when_the_arm_moves_and_not_otherwise():
    env = gym.make("PusherPixels-v5")
    try:
        obs, _ = env.reset(seed=0)
        base = env.unwrapped
        again = _wrapper(env).observation(base._get_obs())
        for cam in ("top", "side"):  # same state -> same pixels (rendering is deterministic)
            np.testing.assert_array_equal(again[cam], obs[cam])
        for _ in range(10):
            moved, *_ = env.step(np.full(7, 2.0, np.float32))
        for cam in ("top", "side"):
            diff = np.abs(moved[cam].astype(int) - obs[cam].astype(int))
            assert (diff.max(-1) > 30).mean() > 0.005, cam  # a visible share of the pixels changed
    finally:
        env.close()


@needs_rendering
def test_check_env_passes():
    env = gym.make("PusherPixels-v5")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            check_env(_wrapper(env), skip_render_check=True)
    finally:
        env.close()


def test_bad_inputs_raise_env_error():
    with pytest.raises(EnvError, match="MuJoCo env"):
        pixels.PixelObservation(gym.make("Pendulum-v1"), pixels.PUSHER_VIEWS)
    from gymnasium.envs.mujoco.pusher_v5 import PusherEnv

    base = PusherEnv()
    try:
        with pytest.raises(EnvError, match="views"):
            pixels.PixelObservation(base, [pixels.PUSHER_VIEWS[0], pixels.PUSHER_VIEWS[0]])
        with pytest.raises(EnvError, match="size"):
            pixels.PixelObservation(base, pixels.PUSHER_VIEWS, size=16)
    finally:
        base.close()
