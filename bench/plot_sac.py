"""The figure of bench/RESULTS.md's sac-diffusion and SAC-vs-SB3 sections, from the benches' JSON:

    python -m bench.plot_sac bench/out/sac_diffusion_a/results.json bench/out/sac_diffusion_b/results.json \
        bench/out/sac_pendulum/sac_vs_sb3-Pendulum-v1.json
"""
import json, matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
import sys

# argv: the sac-diffusion results.json files, then the sac_vs_sb3 json of Pendulum-v1
*diffusion, pendulum = sys.argv[1:]
rows = [r for path in diffusion for r in json.load(open(path))]
pend = json.load(open(pendulum))
fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
seeds = [r["seed"] for r in rows]
ga = [r["share_goal_a"] for r in rows]; gb = [r["share_goal_b"] for r in rows]
a.bar(seeds, ga, label="goal a"); a.bar(seeds, gb, bottom=ga, label="goal b")
a.axhline(0.3, color="k", ls=":", lw=1); a.axhline(0.7, color="k", ls=":", lw=1)
a.set_xlabel("seed"); a.set_ylabel("share of 1000 episodes"); a.set_title("sac-diffusion on PointReach-v0, 120k steps\n(dotted: 30% per goal)")
a.legend(loc="lower right")
x = [r["seed"] for r in pend]
for i, who in enumerate(("ours", "sb3")):
    m = [r[who]["mean"] for r in pend]; lo = [r[who]["mean"] - r[who]["ci95"][0] for r in pend]
    b.errorbar([s + (i - 0.5) * 0.2 for s in x], m, yerr=lo, fmt="o", capsize=3, label={"ours": "rlfunc SAC (compiled)", "sb3": "SB3 SAC"}[who])
b.axhline(-170, color="k", ls=":", lw=1)
b.set_xlabel("seed"); b.set_ylabel("final return, 100 episodes (95% CI)"); b.set_title("SAC on Pendulum-v1, 20k steps, paired episodes")
b.legend()
fig.tight_layout(); fig.savefig("bench/figures/sac_diffusion_and_sac_pendulum.png", dpi=110)
