"""Loss curves of fused contenders against naive and the nudged-weights yardstick, as JSON (no plot).

    PYTHONPATH=. python benchmarks/curves_fused.py --out $OUT/curves.json [--contenders fused,fused-fast]

The same training runs as ``lopt bench --curves`` (lopt/bench/curves.py: a small GPT-2 on a fixed token
stream, bfloat16 autocast, the same initialisation and batches for every run), for machines without
matplotlib. Each contender's record holds the naive curve, its own, the yardstick's (naive with the
meta-weights nudged by 1e-7 relative) and the largest relative difference of each from naive.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import lopt
from lopt.bench.curves import loss_curves
from lopt.bench.report import environment


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--optimizer", default="small_fc_lopt")
    parser.add_argument("--contenders", default="fused,fused-fast")
    parser.add_argument("--model", default="gpt2-4x256")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0, help="seed of the random meta-weights (no hub here)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--lr", type=float, default=None, help="every learned run's lr (default: the optimizer's)")
    parser.add_argument("--weight-decay", type=float, default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    weights = {args.optimizer: lopt.random_weights(args.optimizer, seed=args.seed)}
    options = {key: value for key, value in (("lr", args.lr), ("weight_decay", args.weight_decay)) if value is not None}
    records = {}
    for contender in args.contenders.split(","):
        record = loss_curves([args.optimizer], weights, args.model, steps=args.steps, device=device,
                             contender=contender, why="benchmarks/curves_fused.py", unavailable={args.optimizer: None},
                             options=options)
        records[contender] = record
        differences = record["optimizers"][args.optimizer]["max_rel_diff_vs_naive"]
        print(f"{args.optimizer} {contender}: largest relative loss difference from naive over {args.steps} steps: "
              + ", ".join(f"{label} {value:.3%}" if value is not None else f"{label} not finite"
                          for label, value in differences.items()), flush=True)
    with open(args.out, "w") as f:
        json.dump({"environment": environment(device), "weights": f"random (seed {args.seed})", "curves": records}, f,
                  indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
