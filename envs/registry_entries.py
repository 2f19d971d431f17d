"""Our environments' entries in rlfunc's env registry (:mod:`rlfunc.envs.registry`), registered by
``import envs``: what rlfunc can do with each beyond gymnasium's ``make``.

- PointReach-v0: torch-batched on the device (:class:`envs.point_reach.PointReachEnv`), its bimodal
  scripted expert, and its mode statistics (which goal the episodes reached);
- PushState-v0, Push-v0: the two-route scripted expert (:mod:`envs.push.expert`);
- Warehouse-v0 (:mod:`envs.warehouse`) and rware ids (:mod:`envs.rware_env`): multi-agent envs for
  shared-parameter learners, with their final evaluations.

Light on import: each env's module is imported when an entry's function is first called.
"""

from __future__ import annotations

import statistics

from rlfunc.core.stats import summarize_returns
from rlfunc.envs.registry import EnvEntry, lazy, register


def point_reach_demonstrations(env_id: str, num_episodes: int, horizon: int, *, seed: int, noise_std: float, device):
    """:func:`envs.point_reach.collect_demonstrations` as rlfunc's BC dataset ("observation", "action",
    "episode"), with a torch generator on ``device`` seeded by ``seed``."""
    import torch

    from envs.point_reach import collect_demonstrations

    gen = torch.Generator(device=device).manual_seed(seed)
    data = collect_demonstrations(num_episodes, horizon, generator=gen, device=device, noise_std=noise_std)
    first = torch.ones_like(data["episode"], dtype=torch.bool)
    first[1:] = data["episode"][1:] != data["episode"][:-1]  # one row per episode (the summary lacked success_rate)
    summary = {"success_rate": float(data["success"][first].float().mean()), "num_episodes": num_episodes,
               "num_samples": data.batch_size[0]}
    return data.select("observation", "action", "episode"), summary


def push_demonstrations(env_id: str, num_episodes: int, horizon: int, *, seed: int, noise_std: float, device):
    """:func:`envs.push.expert.collect_demonstrations` (gymnasium episodes) encoded by
    :func:`rlfunc.envs.demos.gym_demonstrations`."""
    from envs.push.expert import collect_demonstrations
    from rlfunc.envs.demos import gym_demonstrations

    return gym_demonstrations(env_id, collect_demonstrations, num_episodes, horizon, seed=seed, noise_std=noise_std,
                              device=device)


def warehouse_config(config, *, train: bool):
    """The Warehouse-v0 config of a mappo run's training (episode length and reward terms from
    ``config``, a MAPPOConfig) or evaluation (defaults, ``config.n_agents`` AGVs)."""
    from envs.warehouse import WarehouseConfig

    if not train:
        return WarehouseConfig(n_agents=config.n_agents)
    return WarehouseConfig(n_agents=config.n_agents, max_steps=config.episode_steps,
                           shaping_scale=config.shaping_scale, conflict_penalty=config.conflict_penalty)


def warehouse_env(config, num_envs: int, device, seed: int, split=None, any_done_of_split=None):
    """:class:`envs.warehouse.WarehouseEnv` of ``num_envs`` training warehouses on ``device`` (a
    data-parallel rank's: its ``split`` of one env of ``seed``)."""
    from envs.warehouse import WarehouseEnv

    return WarehouseEnv(num_envs, warehouse_config(config, train=True), device=device, seed=seed, split=split,
                        any_done_of_split=any_done_of_split)


def warehouse_eval(config, act, device) -> dict:
    """eval.json of a mappo run on Warehouse-v0: the :func:`envs.warehouse.metrics.evaluate` rates
    (deliveries and conflicts per 100 steps, idle fraction) on the default-reward warehouse."""
    from envs.warehouse.metrics import evaluate

    result = evaluate(lambda env: lambda td: act(td["agents", "observation"], td["agents", "action_mask"]),
                      warehouse_config(config, train=False), seeds=config.eval_seeds,
                      num_episodes=config.run.eval_episodes, device=device)
    return {"env": config.env, "n_agents": config.n_agents, "greedy": config.eval_greedy, **result}


def rware_env(config, num_envs: int, device, seed: int):
    """:class:`envs.rware_env.RwareEnv` of ``config.env`` (on the host, whatever ``device``)."""
    from envs.rware_env import RwareEnv

    return RwareEnv(config.env, num_envs, seed=seed)


def rware_eval(config, act, device) -> dict:
    """eval.json of a mappo run on rware: the mean team return (sum over agents) of
    ``config.run.eval_episodes`` episodes per eval seed, and its median over the seeds."""
    import torch

    from envs.rware_env import RwareEnv

    rows = []
    for seed in config.eval_seeds:
        env = RwareEnv(config.env, config.run.eval_episodes, seed=seed)
        td = env.reset()
        total = torch.zeros(config.run.eval_episodes)
        with torch.no_grad():
            for _ in range(env.envs[0].unwrapped.max_steps):
                td.set(("agents", "action"), act(td["agents", "observation"], None))
                stepped, td = env.step_and_maybe_reset(td)
                total += stepped["next", "agents", "reward"].sum((-2, -1))
        rows.append({"seed": seed, **{k if k != "mean" else "team_return": v for k, v in summarize_returns(total).items()}})
    return {"env": config.env, "greedy": config.eval_greedy, "per_seed": rows,
            "median": {"team_return": statistics.median(r["team_return"] for r in rows)}}


register("PointReach-v0", EnvEntry(torch_env=lazy("envs.point_reach:PointReachEnv"),
                                   demonstrations=point_reach_demonstrations,
                                   episode_metrics=lazy("envs.point_reach:rollout_mode_statistics")))
register("PushState-v0", EnvEntry(demonstrations=push_demonstrations))
register("Push-v0", EnvEntry(demonstrations=push_demonstrations))
register("Warehouse-v0", EnvEntry(multi_agent_env=warehouse_env, multi_agent_eval=warehouse_eval, settable_state=True,
                                  multi_agent_split=True,
                                  multi_agent_fields=("n_agents", "episode_steps", "shaping_scale", "conflict_penalty")))
register("rware-*", EnvEntry(multi_agent_env=rware_env, multi_agent_eval=rware_eval))
