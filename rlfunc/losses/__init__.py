"""Losses: pure functions of tensors (and params) returning (loss, metrics TensorDict).

ppo, dppo, grpo, gspo (on-policy); td3 (clipped double-Q target, smoothing, critic and actor losses,
Diffusion-QL's actor); sac (soft target, critic, actor and temperature losses, REDQ's subset min).
The public names are re-exported from ``rlfunc`` (``from rlfunc import soft_q_target``).
"""
