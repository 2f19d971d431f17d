"""PPO's eager update against a bare PyTorch loop of the same loss, without the compiled side: the
two sides of bench/compiled_update.py (HalfCheetah-v5's sizes, a 2048-sample batch, 10 epochs of 32
minibatches of 64, one intra-op thread), a warm-up iteration each, then --repeats iterations
alternating; prints each side's median and the median of eager / bare. Run it in two trees (a
worktree of an older commit, then this one) to compare a change of the eager step:

    for i in 1 2 3; do (cd BEFORE && python -m bench.eager_vs_bare --hidden 64); python -m bench.eager_vs_bare --hidden 64; done
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench.compiled_update import bare_side, rlfunc_side


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=6)
    args = ap.parse_args()
    torch.set_num_threads(1)
    eager, bare = rlfunc_side(args.hidden, "off"), bare_side(args.hidden)
    eager(-1), bare(-1)
    te, tb = [], []
    for r in range(args.repeats):
        te.append(eager(r))
        tb.append(bare(r))
    ratio = statistics.median(e / b for e, b in zip(te, tb))
    print(f"hidden {args.hidden}: eager {statistics.median(te):.3f} s, bare {statistics.median(tb):.3f} s, eager / bare {ratio:.3f}")


if __name__ == "__main__":
    main()
