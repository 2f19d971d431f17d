"""rlfunc: functional reinforcement learning on PyTorch (torch.func + TensorDict).

The public names, re-exported here as rlax does (``from rlfunc import generalized_advantage_estimate,
ppo_loss``); each is imported from its module on first use, so ``import rlfunc`` stays cheap. The
layers behind them are drawn in docs/ARCHITECTURE.md.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> the module that defines it
_PUBLIC = {
    **dict.fromkeys(("generalized_advantage_estimate", "discounted_returns", "group_relative_advantage",
                     "reverse_discounted_cumsum", "forward_discounted_sum"), "rlfunc.core.returns"),
    **dict.fromkeys(("gaussian_log_prob", "gaussian_entropy", "gaussian_sample", "tanh_gaussian_sample",
                     "tanh_gaussian_log_prob", "masked_logits", "categorical_log_prob", "categorical_entropy",
                     "categorical_sample", "categorical_mode"), "rlfunc.core.distributions"),
    **dict.fromkeys(("init_running_stats", "update_running_stats", "merge_running_stats", "normalize", "denormalize",
                     "scale_reward"), "rlfunc.core.normalize"),
    **dict.fromkeys(("params_from_module", "apply", "stack_params", "vmap"), "rlfunc.core.func"),
    **dict.fromkeys(("sde_sample", "sde_log_prob", "sde_entropy", "draw_exploration_matrix"), "rlfunc.core.sde"),
    **dict.fromkeys(("mean_interval", "summarize_returns", "success_interval", "first_touch", "reach_and_stay"),
                    "rlfunc.core.stats"),
    **dict.fromkeys(("ppo_loss", "clipped_surrogate", "normalize_advantage", "explained_variance"), "rlfunc.losses.ppo"),
    "dppo_loss": "rlfunc.losses.dppo",
    "grpo_loss": "rlfunc.losses.grpo",
    "gspo_loss": "rlfunc.losses.gspo",
    **dict.fromkeys(("td3_target", "critic_loss", "diffusion_ql_actor_loss", "smoothed_target_action", "td3_actor_loss"),
                    "rlfunc.losses.td3"),
    **dict.fromkeys(("soft_q_target", "sac_critic_loss", "sac_actor_loss", "temperature_loss", "ensemble_min"),
                    "rlfunc.losses.sac"),
    **dict.fromkeys(("GaussianMixture", "fit_gmm", "gmm_log_prob", "gmm_sample", "gmm_entropy"), "rlfunc.diffusion.entropy"),
    **dict.fromkeys(("GradientTransform", "chain", "adam", "clip_by_global_norm", "apply_updates", "linear_lr"),
                    "rlfunc.optim"),
    **dict.fromkeys(("Run", "RunResult", "run_loop", "train"), "rlfunc.run"),
    "resume": "rlfunc.run.loop",
    "RunConfig": "rlfunc.config",
}

__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'rlfunc' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
