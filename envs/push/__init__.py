"""Push-v0 and PushState-v0: a 6-joint arm pushes a slider block to a target (``envs.push.env``),
and a scripted two-route expert with demonstration collection (``envs.push.expert``).

Importing this package is light; ``envs.push.env`` imports mujoco (and sets ``MUJOCO_GL``).
"""
