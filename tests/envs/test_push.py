"""Push-v0 / PushState-v0: gymnasium checks, observation layout and ranges, the IK's direction and
limits, reward/success consistency, reset randomisation, env-state round trip, the two-route scripted
expert and demonstration collection. Tests that need a working OpenGL skip when none is available."""

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import envs  # noqa: F401  (registers Push-v0 and PushState-v0)
from envs.push import env as pe
from envs.push import expert as px
from rlfunc.envs import collect
from rlfunc.errors import ConfigError, EnvError

ROOT = Path(__file__).resolve().parents[2]
LAYOUT = pe.STATE_LAYOUT


RENDERING = pe.rendering_available()
needs_rendering = pytest.mark.skipif(not RENDERING, reason=f"no working OpenGL (backend {pe.gl_backend()})")


def state_env(**kwargs):
    return gym.make("PushState-v0", **kwargs)


def test_registration_matches_module_constants_and_import_stays_light():
    for env_id in ("Push-v0", "PushState-v0"):
        assert gym.spec(env_id).max_episode_steps == pe.MAX_STEPS
    code = "import sys, envs; assert 'mujoco' not in sys.modules and 'envs.push.env' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
    u = pe.PushStateEnv()  # push.xml agrees with the constants the docs, reward and expert use
    size = {name: u.model.geom(name).size for name in ("block", "paddle")}
    np.testing.assert_allclose(size["block"], [pe.BLOCK_HALF, pe.BLOCK_HALF, pe.BLOCK_HEIGHT / 2])
    assert size["paddle"][0] == pe.PADDLE_RADIUS
    assert u.model.opt.timestep * pe.N_SUBSTEPS == pytest.approx(pe.CONTROL_PERIOD)
    u.data.qpos[:6] = pe.HOME_QPOS
    pe.mujoco.mj_forward(u.model, u.data)
    np.testing.assert_allclose(u.ee_position, pe.HOME_EE, atol=1e-6)


def test_gl_backend_choice():
    assert pe._pick_gl_backend(True, True, False) == "egl"
    assert pe._pick_gl_backend(False, True, True) == "osmesa"
    assert pe._pick_gl_backend(False, False, True) == ""
    assert pe._pick_gl_backend(False, False, False) == "disable"
    assert pe.gl_backend() in ("egl", "osmesa", "glfw", "disable")


@needs_rendering
def test_renders_when_mujoco_was_imported_first():
    # torchrl.envs imports mujoco with MUJOCO_GL unset (GLFW, which needs a display); the env must
    # still render headless through EGL / OSMesa
    code = (
        "import os, sys; os.environ.pop('MUJOCO_GL', None); os.environ.pop('PYOPENGL_PLATFORM', None); "
        "os.environ.pop('DISPLAY', None); import mujoco, gymnasium as gym, envs; "
        "from envs.push import env as pe; e = gym.make('Push-v0'); o, _ = e.reset(seed=0); e.close(); "
        "assert o['top'].std() > 5; print(pe.gl_backend())"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("MUJOCO_GL", "PYOPENGL_PLATFORM", "DISPLAY")}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() in ("egl", "osmesa") and "Traceback" not in out.stderr


def test_rendering_disabled_is_one_error_without_a_traceback():
    """New-user pass: with MUJOCO_GL=disable (the fallback on a machine without EGL or OSMesa) the one-line
    EnvError was followed by "Exception ignored in: <function Renderer.__del__>" tracebacks from a
    half-built renderer. Now the error comes before any renderer is built."""
    code = (
        "import gymnasium as gym, envs\nfrom rlfunc.errors import EnvError\n"
        "try:\n    gym.make('Push-v0').reset(seed=0)\nexcept EnvError as e:\n    print('EnvError', e)\n"
    )
    env = {**os.environ, "MUJOCO_GL": "disable"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("EnvError Push-v0 cannot render (MUJOCO_GL=disable") and "PushState-v0" in out.stdout
    assert "Exception ignored" not in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]


@needs_rendering
def test_async_vector_env_keeps_the_instructions_and_starts_after_rendering():
    """New-user pass: make_vec_env("Push-v0", 2, vectorization="async") returned "aaaa..." for every
    instruction (gymnasium's shared memory keeps a Text space's placeholder), and after this process had
    rendered a Push-v0 env its forked workers deadlocked in EGL (reset never returned). Run in a child
    with a time limit, so that a regression fails instead of hanging the suite."""
    code = (
        "import gymnasium as gym, envs\nfrom rlfunc.envs.collect import make_vec_env\n"
        "gym.make('Push-v0').reset(seed=0)\n"
        "a = make_vec_env('Push-v0', 2, vectorization='async'); oa, _ = a.reset(seed=0); a.close()\n"
        "s = make_vec_env('Push-v0', 2); os_, _ = s.reset(seed=0); s.close()\n"
        "assert tuple(oa['instruction']) == tuple(os_['instruction']), (oa['instruction'], os_['instruction'])\n"
        "assert (oa['top'] == os_['top']).all() and not oa['instruction'][0].startswith('aaaa')\nprint('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_check_env_state():
    env = state_env()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the unbounded Box's warnings
        check_env(env.unwrapped, skip_render_check=True)
    env.close()


@needs_rendering
def test_check_env_pixels():
    env = gym.make("Push-v0")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_env(env.unwrapped, skip_render_check=True)
    env.close()


def test_state_observation_layout_and_ranges():
    env = state_env()
    u = env.unwrapped
    joint_range = u.model.jnt_range[:6]
    (x0, x1), (y0, y1) = pe.BLOCK_REGION
    for seed in range(5):
        obs, info = env.reset(seed=seed)
        assert obs.shape == (pe.STATE_DIM,) and obs.dtype == np.float32 and env.observation_space.contains(obs)
        assert info["is_success"] is False
        for t in range(8):
            q = obs[LAYOUT["joint_angle"]]
            assert np.all(q >= joint_range[:, 0] - 1e-3) and np.all(q <= joint_range[:, 1] + 1e-3)
            np.testing.assert_allclose(obs[LAYOUT["joint_angle"]], u.data.qpos[:6], rtol=0, atol=1e-6)
            np.testing.assert_allclose(obs[LAYOUT["joint_velocity"]], u.data.qvel[:6], rtol=1e-6, atol=1e-5)
            np.testing.assert_allclose(obs[LAYOUT["block_xy"]], u.block_position, rtol=0, atol=1e-6)
            np.testing.assert_allclose(obs[LAYOUT["target_xy"]], u.target_position, rtol=0, atol=1e-6)
            np.testing.assert_allclose(obs[LAYOUT["ee_xyz"]], u.ee_position, rtol=0, atol=1e-6)
            s, c = obs[LAYOUT["block_yaw_sin_cos"]]
            assert s * s + c * c == pytest.approx(1.0, abs=1e-5)
            assert np.arctan2(s, c) == pytest.approx(np.arctan2(np.sin(u.block_yaw), np.cos(u.block_yaw)), abs=1e-5)
            # the block stays on the table top; the paddle in its height band (with the servo's lag)
            bx, by = obs[LAYOUT["block_xy"]]
            assert -0.05 <= bx <= 0.85 and -0.45 <= by <= 0.45
            assert pe.EE_Z_RANGE[0] - 0.01 <= obs[LAYOUT["ee_xyz"]][2] <= pe.EE_Z_RANGE[1] + 0.01
            tx, ty = obs[LAYOUT["target_xy"]]
            assert x0 <= tx <= x1 and y0 <= ty <= y1
            obs, *_ = env.step(env.action_space.sample())
    env.close()


@needs_rendering
def test_pixel_observation_matches_state_variant():
    pix, st = gym.make("Push-v0"), state_env()
    obs, _ = pix.reset(seed=3)
    sobs, _ = st.reset(seed=3)
    assert set(obs) == {"top", "side", "proprio", "instruction"}
    for cam in pe.CAMERAS:
        img = obs[cam]
        assert img.shape == (pe.IMAGE_SIZE, pe.IMAGE_SIZE, 3) and img.dtype == np.uint8
        assert img.std() > 5  # a scene, not a blank frame
    assert not np.array_equal(obs["top"], obs["side"])
    assert obs["proprio"].shape == (pe.PROPRIO_DIM,) and obs["proprio"].dtype == np.float32
    assert obs["instruction"] in pe.INSTRUCTIONS and pix.observation_space.contains(obs)
    np.testing.assert_array_equal(obs["proprio"], sobs[:16])
    action = np.array([0.2, -0.1, 0.0], np.float32)
    before = obs["top"]
    for _ in range(3):
        obs, *_ = pix.step(action)
        sobs, *_ = st.step(action)
    np.testing.assert_array_equal(obs["proprio"], sobs[:16])  # same dynamics, rendering aside
    assert not np.array_equal(obs["top"], before)  # the arm moved in the picture
    instructions = {pix.reset(seed=s)[0]["instruction"] for s in range(12)}
    assert len(instructions) >= 3
    pix.close()
    st.close()


def test_state_variant_never_renders(monkeypatch):
    def no_gl(*args, **kwargs):
        raise AssertionError("PushState-v0 created a renderer")

    monkeypatch.setattr(pe.mujoco, "Renderer", no_gl)
    env = state_env()
    env.reset(seed=0)
    for _ in range(3):
        env.step(env.action_space.sample())
    assert env.unwrapped._renderer is None and env.render() is None
    env.close()


def test_missing_gl_is_a_one_line_env_error(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("Cannot create an EGL context.")

    monkeypatch.setattr(pe.mujoco, "Renderer", broken)
    env = pe.PushEnv()
    with pytest.raises(EnvError, match="install") as e:
        env.reset(seed=0)
    assert "\n" not in str(e.value) and "PushState-v0" in str(e.value)
    with pytest.raises(EnvError, match="render_mode"):
        pe.PushEnv(render_mode="human")


@pytest.mark.parametrize("axis", [0, 1, 2])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_ik_moves_the_paddle_in_the_commanded_direction(axis, sign):
    env = state_env()
    u = env.unwrapped
    env.reset(seed=11)
    if axis == 2 and sign < 0:  # start high enough to go down within the height band
        for _ in range(2):
            env.step(np.array([0.0, 0.0, pe.MAX_EE_SPEED], np.float32))
    start = u.ee_position
    action = np.zeros(3, np.float32)
    action[axis] = sign * pe.MAX_EE_SPEED
    for _ in range(2 if axis == 2 else 4):
        env.step(action)
    moved = u.ee_position - start
    cosine = sign * moved[axis] / np.linalg.norm(moved)
    assert cosine > 0.9, (moved, cosine)
    assert np.linalg.norm(moved) > 0.5 * pe.MAX_EE_SPEED * pe.CONTROL_PERIOD * (2 if axis == 2 else 4)
    axis_z = u.data.site_xmat[u._site].reshape(3, 3)[:, 2]
    assert axis_z[2] > np.cos(0.05)  # the paddle's axis stays vertical
    env.close()


def test_workspace_velocity_clamp():
    ee = np.array([0.3, 0.0, 0.05])
    v = np.array([0.1, -0.05, 0.02])
    np.testing.assert_allclose(pe.workspace_velocity(ee, v), v, atol=1e-12)  # inside: unchanged
    T = pe.CONTROL_PERIOD
    assert pe.workspace_velocity(ee, [0, 0, -0.25])[2] == pytest.approx((pe.EE_Z_RANGE[0] - 0.05) / T)
    at_rim = np.array([pe.EE_RADIUS_RANGE[1], 0.0, 0.05])
    np.testing.assert_allclose(pe.workspace_velocity(at_rim, [0.25, 0.1, 0]), [0, 0.1, 0], atol=0.01)
    v = pe.workspace_velocity(np.array([0.16, 0.0, 0.05]), [-0.25, 0, 0])
    assert v[0] == pytest.approx((pe.EE_RADIUS_RANGE[0] - 0.16) / T)


def test_workspace_and_joint_limits_hold():
    env = state_env()
    u = env.unwrapped
    env.reset(seed=2)
    joint_range = u.model.jnt_range[:6]
    for action, steps in (([0, 0, -1], 10), ([0, 0, 1], 12), ([1, 0, -1], 40), ([0, 1, 0], 40), ([-1, -1, 0], 60)):
        for _ in range(steps):
            obs, *_ = env.step(pe.MAX_EE_SPEED * np.array(action, np.float32))
            x, y, z = u.ee_position
            assert pe.EE_Z_RANGE[0] - 0.01 <= z <= pe.EE_Z_RANGE[1] + 0.01
            assert pe.EE_RADIUS_RANGE[0] - 0.01 <= np.hypot(x, y) <= pe.EE_RADIUS_RANGE[1] + 0.01
            assert abs(np.arctan2(y, x)) <= pe.EE_MAX_AZIMUTH + 0.02
            q = u.data.qpos[:6]
            assert np.all(q >= joint_range[:, 0] - 0.02) and np.all(q <= joint_range[:, 1] + 0.02)
            assert np.all(u.data.act >= joint_range[:, 0] - 1e-9) and np.all(u.data.act <= joint_range[:, 1] + 1e-9)
            assert np.all(np.isfinite(obs))
    env.close()


def test_actions_are_clipped_and_nan_is_zero():
    a, b = state_env(), state_env()
    a.reset(seed=4)
    b.reset(seed=4)
    oa, ra, *_ = a.step(np.array([9.0, -9.0, np.nan], np.float32))
    ob, rb, *_ = b.step(np.array([pe.MAX_EE_SPEED, -pe.MAX_EE_SPEED, 0.0], np.float32))
    np.testing.assert_array_equal(oa, ob)
    assert ra == rb


def _reward_from_obs(obs: np.ndarray, success: bool) -> float:
    block = np.array([*obs[LAYOUT["block_xy"]], pe.BLOCK_HEIGHT / 2])
    ee_to_block = np.linalg.norm(obs[LAYOUT["ee_xyz"]] - block)
    block_to_target = np.linalg.norm(obs[LAYOUT["block_xy"]] - obs[LAYOUT["target_xy"]])
    return -(ee_to_block + pe.TARGET_WEIGHT * block_to_target) + (pe.SUCCESS_BONUS if success else 0.0)


def test_reward_and_success_are_consistent():
    env = state_env()
    rng = np.random.default_rng(0)
    successes = 0
    for seed in (0, 1):
        obs, _ = env.reset(seed=seed)
        route = px.choose_route(env.unwrapped, rng)
        for t in range(pe.MAX_STEPS):
            action = px.expert_action(env.unwrapped, route) if seed == 0 else env.action_space.sample()
            obs, reward, term, trunc, info = env.step(action)
            block_to_target = np.linalg.norm(obs[LAYOUT["block_xy"]] - obs[LAYOUT["target_xy"]])
            assert isinstance(info["is_success"], bool)
            assert info["is_success"] == term == (block_to_target <= pe.SUCCESS_RADIUS + 1e-6)
            assert info["block_to_target"] == pytest.approx(block_to_target, abs=1e-5)
            assert reward == pytest.approx(_reward_from_obs(obs, info["is_success"]), abs=1e-4)
            successes += term
            if term or trunc:
                break
        assert trunc == (not term) and t + 1 == (t + 1 if term else pe.MAX_STEPS)
    assert successes == 1  # the expert's episode ends in success, the random one runs out of time
    env.close()


def test_reset_is_random_within_reach_and_reproducible():
    env = state_env()
    (x0, x1), (y0, y1) = pe.BLOCK_REGION
    blocks, targets, ees = [], [], []
    for seed in range(40):
        obs, _ = env.reset(seed=seed)
        block, target = obs[LAYOUT["block_xy"]], obs[LAYOUT["target_xy"]]
        assert x0 <= block[0] <= x1 and y0 <= block[1] <= y1
        assert x0 <= target[0] <= x1 and y0 <= target[1] <= y1
        assert pe.TARGET_DISTANCE[0] - 1e-6 <= np.linalg.norm(target - block) <= pe.TARGET_DISTANCE[1] + 1e-6
        blocks.append(block)
        targets.append(target)
        ees.append(obs[LAYOUT["ee_xyz"]])
    # within reach: the farthest point the paddle must reach (behind the block, ORBIT_RADIUS round it)
    # is well inside the arm's stretched length (0.64 m from the shoulder, 0.3 m above the table)
    far = np.max(np.linalg.norm(np.array(blocks), axis=1)) + px.ORBIT_RADIUS
    assert np.hypot(far - 0.04, 0.3 - (pe.EE_Z_RANGE[0] + 0.14)) < 0.62
    assert np.std(blocks, axis=0).min() > 0.02 and np.std(targets, axis=0).min() > 0.02
    np.testing.assert_allclose(np.mean(ees, axis=0), pe.HOME_EE, atol=0.02)
    first, _ = env.reset(seed=7)
    again, _ = env.reset(seed=7)
    np.testing.assert_array_equal(first, again)
    env.close()


def test_env_state_round_trip():
    a, b = collect.make_vec_env("PushState-v0", 2), collect.make_vec_env("PushState-v0", 2)
    a.reset(seed=[1, 2])
    b.reset(seed=[5, 6])
    rng = np.random.default_rng(0)
    for _ in range(5):
        a.step(rng.uniform(-0.25, 0.25, (2, 3)).astype(np.float32))
    state = collect.env_state(a)
    assert state is not None and all("mujoco" in s for s in state)
    collect.set_env_state(b, json.loads(json.dumps(state)))
    ended = 0
    for t in range(100):  # across the time limit: the autoreset draws from the restored RNGs
        action = rng.uniform(-0.25, 0.25, (2, 3)).astype(np.float32)
        oa, ra, ta, ua, _ = a.step(action)
        ob, rb, tb, ub, _ = b.step(action)
        for x, y in ((oa, ob), (ra, rb), (ta, tb), (ua, ub)):
            np.testing.assert_array_equal(x, y, err_msg=f"step {t}")
        ended += int((ta | ua).sum())
    assert ended >= 2  # both episodes ended on the way
    a.close()
    b.close()


def test_expert_succeeds_on_fixed_seeds():
    demos = px.collect_demonstrations("PushState-v0", 5, seed=0)
    assert demos["is_success"].sum() >= 4
    assert demos["length"].max() <= pe.MAX_STEPS


def test_expert_uses_both_routes_and_they_go_round_opposite_sides():
    demos = px.collect_demonstrations("PushState-v0", 10, seed=100)
    routes = set(demos["route"])
    assert {"left", "right"} <= routes, demos["route"]
    assert demos["success_rate"] >= 0.8
    for ep in demos["episodes"]:
        if ep["route"] == "direct":
            continue
        obs = ep["observations"]
        block, target, ee = obs[:, LAYOUT["block_xy"]], obs[:, LAYOUT["target_xy"]], obs[:, LAYOUT["ee_xyz"]][:, :2]
        u = (target - block) / np.linalg.norm(target - block, axis=1, keepdims=True)
        n = np.stack([-u[:, 1], u[:, 0]], 1)
        rel = ee - block
        along, lateral = (rel * u).sum(1), (rel * n).sum(1)
        # the angle swept round the block until the paddle is first behind it: + counter-clockwise
        behind = int(np.argmax(along < -px.BEHIND))
        assert behind > 0
        angle = np.unwrap(np.arctan2(lateral[: behind + 1], along[: behind + 1]))
        swept = angle[-1] - angle[0]
        assert abs(swept) > 0.05 and np.sign(swept) == (1.0 if ep["route"] == "left" else -1.0), ep["seed"]


def test_demonstration_arrays():
    demos = px.collect_demonstrations("PushState-v0", 2, seed=5)
    assert len(demos["episodes"]) == 2 and demos["video"] is None
    for ep in demos["episodes"]:
        t = len(ep["actions"])
        assert ep["observations"].shape == (t + 1, pe.STATE_DIM) and ep["observations"].dtype == np.float32
        assert ep["actions"].shape == (t, 3) and ep["actions"].dtype == np.float32
        assert np.abs(ep["actions"]).max() <= pe.MAX_EE_SPEED
        assert ep["rewards"].shape == ep["terminated"].shape == ep["truncated"].shape == (t,)
        assert ep["terminated"][-1] or ep["truncated"][-1]
        assert ep["route"] in px.ROUTES
    assert sum(demos["route_share"].values()) == pytest.approx(1.0)
    with pytest.raises(ConfigError, match="num_episodes"):
        px.collect_demonstrations("PushState-v0", 0)
    with pytest.raises(EnvError, match="Push env"):
        px.collect_demonstrations("PointReach-v0", 1)
    env = state_env()
    env.reset(seed=0)
    with pytest.raises(ConfigError, match="route"):
        px.expert_action(env.unwrapped, "up")
    env.close()


@needs_rendering
def test_demonstration_video(tmp_path):
    pytest.importorskip("imageio")
    path = tmp_path / "push.gif"
    demos = px.collect_demonstrations("PushState-v0", 1, seed=0, video_path=path)
    if demos["video"] is None:
        pytest.skip("imageio has no writer for .gif here")
    assert path.stat().st_size > 1000
