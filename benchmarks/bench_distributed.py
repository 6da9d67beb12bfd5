"""FSDP2 against one process: lopt's optimizers, with fused AdamW as the yardstick, on a GPT-2-shaped model.

Run under torchrun with 2 processes (NCCL on CUDA, gloo on the CPU), from the repository root:

    torchrun --standalone --nproc-per-node 2 benchmarks/bench_distributed.py --json out.json
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_distributed.py --n-layer 2 --n-embd 64 --n-head 2 \\
        --seq 32 --batch 4          # a small model, e.g. on the CPU

Every process builds the same randomly initialised ``GPT2LMHeadModel`` (transformers; nothing is
downloaded; dropout off). For each optimizer:

1. process 0 alone trains an unsharded copy on the whole batches (``process_group="local"``);
2. both processes train an FSDP2-sharded copy (``fully_shard`` on every block and the root), each
   on its half of every batch;
3. per tensor, ``‖Δsharded − Δsingle‖ / ‖Δsingle‖`` with ``Δ`` = final − initial parameters:
   worst and median over the tensors.

It also times ``optimizer.step()`` (median over the steps after the first) in both runs and
counts lopt's collectives and bytes per step. VeLO is handed, in both runs, the mean of the two
half-batch losses (the number the processes agree on; see docs/distributed.md). Writes a JSON
file and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

import lopt
from lopt.bench.report import environment

VOCAB = 50257


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="naive", choices=["naive", "fused", "auto"],
                        help="lopt backend for both runs (auto: fused where it can, e.g. VeLO on DTensors runs naive)")
    parser.add_argument("--optimizers", default="small_fc_lopt,velo,adamw")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--n-layer", type=int, default=12)
    parser.add_argument("--n-embd", type=int, default=768)
    parser.add_argument("--n-head", type=int, default=12)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="global batch (split evenly over the processes)")
    parser.add_argument("--json", default=None, help="write the results here (process 0)")
    return parser.parse_args()


def make_model(args, device):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, vocab_size=VOCAB,
                        n_positions=max(1024, args.seq), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return GPT2LMHeadModel(config).to(device)


def batch(args, step, device, part=None, parts=1):
    g = torch.Generator().manual_seed(10_000 + step)
    tokens = torch.randint(0, VOCAB, (args.batch, args.seq), generator=g)
    if part is not None:
        size = args.batch // parts
        tokens = tokens[part * size:(part + 1) * size]
    return tokens.to(device)


def loss_of(model, tokens):
    return model(input_ids=tokens, labels=tokens).loss


def make_optimizer(name, params, args, **kwargs):
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, fused=params[0].device.type == "cuda")
    if name == "velo":
        return lopt.VeLO(params, num_steps=1000, weights=lopt.random_weights("velo", seed=1), backend=args.backend,
                         **kwargs)
    return lopt.SmallFCLOpt(params, weights=lopt.random_weights("small_fc_lopt", seed=1), backend=args.backend,
                            **kwargs)


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(name, model, opt, args, device, world, rank, sharded):
    """``args.steps`` steps; returns the step times (s). ``sharded``: this process's half of each batch."""
    times = []
    for step in range(args.steps):
        opt.zero_grad(set_to_none=True)
        tokens = batch(args, step, device, rank if sharded else None, world if sharded else 1)
        loss = loss_of(model, tokens)
        loss.backward()
        if name == "velo" and not sharded:
            with torch.no_grad():  # the mean of the half-batch losses: what the sharded run's processes agree on
                loss = torch.stack([loss_of(model, batch(args, step, device, r, world)) for r in range(world)]).mean()
        synchronize(device)
        start = time.perf_counter()
        if name == "velo":
            opt.step(loss.detach())
        else:
            opt.step()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def full_parameters(model):
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().double().cpu()
            for n, p in model.named_parameters()}


def sharded_copy(args, device, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = make_model(args, device)
    mesh = init_device_mesh(device.type, (world,))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def median_ms(times):
    return 1e3 * statistics.median(times[1:] if len(times) > 1 else times)


def compare(name, args, device, world, rank):
    result = {}
    initial = full_parameters(make_model(args, device))
    single = None
    if rank == 0:
        model = make_model(args, device)
        kwargs = {} if name == "adamw" else {"process_group": "local"}
        try:
            opt = make_optimizer(name, list(model.parameters()), args, **kwargs)
        except (RuntimeError, TypeError, ValueError) as err:
            result["single_error"] = str(err)
        else:
            result["single_step_ms"] = median_ms(train(name, model, opt, args, device, world, rank, sharded=False))
            result["single_backend"] = getattr(opt, "backend", "torch")
            single = full_parameters(model)
            del opt
        del model
    refused = [bool(result.get("single_error"))]
    dist.broadcast_object_list(refused, src=0)
    if refused[0]:
        return result
    dist.barrier()
    model = sharded_copy(args, device, world)
    try:
        opt = make_optimizer(name, list(model.parameters()), args)
    except (RuntimeError, TypeError, ValueError) as err:
        result["sharded_error"] = str(err)
        return result
    times = train(name, model, opt, args, device, world, rank, sharded=True)
    result["sharded_step_ms"] = median_ms(times)
    if name != "adamw":
        result["sharded_backend"] = opt.backend
        result["collectives_per_step"] = opt.reducer.collectives / args.steps
        result["bytes_per_step"] = opt.reducer.bytes_reduced / args.steps
    sharded = full_parameters(model)
    if rank == 0:
        errors = {}
        for n, want in single.items():
            update = want - initial[n]
            errors[n] = float((sharded[n] - want).norm() / update.norm()) if update.norm() > 0 else 0.0
        worst = max(errors, key=errors.get)
        result.update(worst=errors[worst], worst_tensor=worst, median=statistics.median(errors.values()),
                      tensors=len(errors))
    return result


def table_lines(report) -> list:
    """The results as a short text table: per-tensor relative error of the sharded run's updates
    (worst, median), step times and lopt's collectives per step."""
    config = report["config"]
    lines = [f"GPT-2 n_layer={config['n_layer']} n_embd={config['n_embd']}, {report['world']} processes "
             f"({report['backend']}, {report['device']}), {config['steps']} steps, lopt backend {config['backend']}",
             f"{'optimizer':14} {'worst':>9} {'median':>9}  {'worst tensor':34} {'single ms':>9} {'sharded ms':>10} "
             f"{'coll/step':>9} {'bytes/step':>10}"]
    for name, r in report["results"].items():
        refusal = r.get("single_error") or r.get("sharded_error")
        if refusal:
            run = "single-GPU" if "single_error" in r else "sharded"
            lines.append(f"{name:14} {run} run refused: {refusal}")
            continue
        lines.append(f"{name:14} {r['worst']:9.2e} {r['median']:9.2e}  {r['worst_tensor']:34} "
                     f"{r['single_step_ms']:9.1f} {r['sharded_step_ms']:10.1f} {r.get('collectives_per_step', 0):9.1f} "
                     f"{r.get('bytes_per_step', 0):10.0f}")
    return lines


def main():
    args = parse_args()
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} must be divisible by the {world} processes")
    if use_cuda:
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        device = torch.device("cpu")
    results = {}
    for name in args.optimizers.split(","):
        results[name] = compare(name, args, device, world, rank)
        dist.barrier()
    if rank == 0:
        report = {**environment(device), "world": world, "backend": dist.get_backend(), "config": vars(args),
                  "results": results}
        table = table_lines(report)
        print("\n".join(table))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)
            with open(os.path.splitext(args.json)[0] + ".txt", "w") as f:
                f.write("\n".join(table) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
