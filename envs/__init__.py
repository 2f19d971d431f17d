"""rlfunc's own environments, registered with gymnasium on import."""

import gymnasium as gym

RLFUNC_ENVS = True  # what rlfunc.envs.registry checks: this `envs` is rlfunc's, not another package of that name

# The entry point is a string so `import envs` stays light (envs.point_reach imports torchrl);
# 30 is envs.point_reach.MAX_STEPS (a test checks they agree).
if "PointReach-v0" not in gym.registry:
    gym.register(id="PointReach-v0", entry_point="envs.point_reach:PointReachGymEnv", max_episode_steps=30)

# envs.push.env imports mujoco (and sets MUJOCO_GL for headless rendering) only when an env is made;
# 100 is envs.push.env.MAX_STEPS (a test checks they agree).
if "Push-v0" not in gym.registry:
    gym.register(id="Push-v0", entry_point="envs.push.env:PushEnv", max_episode_steps=100)
if "PushState-v0" not in gym.registry:
    gym.register(id="PushState-v0", entry_point="envs.push.env:PushStateEnv", max_episode_steps=100)

# Pusher-v5 with two rendered 128x128 cameras + its state vector as "proprio" (envs.pixels imports
# mujoco and sets MUJOCO_GL only when the env is made); 100 steps as Pusher-v5.
if "PusherPixels-v5" not in gym.registry:
    gym.register(id="PusherPixels-v5", entry_point="envs.pixels:make_pusher_pixels", max_episode_steps=100)

# rlfunc's env registry: torch-batched builders, experts, metrics, multi-agent envs (envs/registry_entries.py).
from envs import registry_entries  # noqa: E402,F401
