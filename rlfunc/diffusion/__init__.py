"""Diffusion policies: noise schedules (``schedule``), DDPM training (``ddpm``) and the DDIM sampler
with in-graph gradients and a per-step chain log-likelihood for policy-gradient fine-tuning (``ddim``);
DACER's entropy estimate of a policy from its samples, a Gaussian mixture fitted by EM (``entropy``).

Conventions shared by every module here: an action chunk is ``[*B, H, A]`` (batch dims, horizon,
action dim), float32; a diffusion timestep is an int64 tensor in ``[0, T)`` where ``T`` is the number
of training steps, with ``-1`` standing for "no noise" (alpha_prod = 1) after the last DDIM step; the
schedule is a TensorDict with ``"betas"``, ``"alphas"`` and ``"alphas_cumprod"`` (``make_schedule``),
and ``alphas_cumprod`` travels in every checkpoint (``check_schedule``). Randomness is always passed
in (``noise``, ``generator``); nothing here draws from a global generator on its own.
"""
