"""The glue under several processes: it hands each micro-batch's loss over as it is, VeLO averages
the step's loss over the processes, so the processes stay in step (two CPU processes, gloo)."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import lopt
from integrations_support import VELO_WEIGHTS
from spawned import leave_process
from lopt.integrations._common import feed_loss

WORLD = 2
# Each process's micro-batch losses for two steps of two micro-batches (different on each process).
LOCAL_LOSSES = {0: [[1.0, 3.0], [0.5, 0.25]], 1: [[2.0, 6.0], [1.5, 0.75]]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        torch.manual_seed(0)  # the same parameters and gradients on every process, as DDP keeps them
        param = torch.nn.Parameter(torch.randn(4, 3))
        velo = lopt.VeLO([param], num_steps=2, weights=VELO_WEIGHTS, backend="naive")
        for step_losses in LOCAL_LOSSES[rank]:
            for loss in step_losses:
                feed_loss(velo, torch.tensor(loss), multiplier=2)  # (as if divided by 2 micro-batches)
            param.grad = torch.full_like(param, 0.1)
            velo.step()
        results[rank] = (param.detach().clone(), velo.param_groups[0]["loss_means"].clone())
    finally:
        dist.destroy_process_group()
    leave_process()  # (an exception above ends the process with its error instead)


@pytest.mark.skipif(not dist.is_available(), reason="this torch has no torch.distributed")
def test_processes_feed_the_same_averaged_loss_and_stay_identical():
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(_free_port(), results), nprocs=WORLD, join=True)
    (param0, means0), (param1, means1) = results[0], results[1]
    assert torch.equal(param0, param1) and torch.equal(means0, means1)

    # One process alone, fed the per-step means over both processes' micro-batches, does the same.
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(4, 3))
    velo = lopt.VeLO([param], num_steps=2, weights=VELO_WEIGHTS, backend="naive")
    for t in range(2):
        losses = [2 * loss for rank in range(WORLD) for loss in LOCAL_LOSSES[rank][t]]
        param.grad = torch.full_like(param, 0.1)
        velo.step(sum(losses) / len(losses))
    torch.testing.assert_close(param0, param.detach(), rtol=1e-6, atol=0)
    torch.testing.assert_close(means0, velo.param_groups[0]["loss_means"], rtol=1e-6, atol=0)
