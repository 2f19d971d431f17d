"""rlfunc's own environments, registered with gymnasium on import."""

import gymnasium as gym

# The entry point is a string so `import envs` stays light (envs.point_reach imports torchrl);
# 30 is envs.point_reach.MAX_STEPS (a test checks they agree).
if "PointReach-v0" not in gym.registry:
    gym.register(id="PointReach-v0", entry_point="envs.point_reach:PointReachGymEnv", max_episode_steps=30)
