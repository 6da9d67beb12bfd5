"""lopt under torch.distributed (CPU, gloo, 2 processes): DDP, ZeroRedundancyOptimizer and FSDP2 step
exactly like one process holding the whole model and batch; sharded checkpoints resume exactly;
unsupported layouts are refused before anything changes.

The two processes are spawned once for the module (``distributed_results``): each runs every
scenario and saves what it saw; the tests compare that with single-process runs made here.
"""

from __future__ import annotations

import math
import os
import re
import socket
import tempfile
import time
import traceback
import warnings

import pytest
import torch
import torch.nn.functional as F

import lopt
from lopt import registry
from spawned import leave_process

dist = pytest.importorskip("torch.distributed")
if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("needs torch.distributed with gloo", allow_module_level=True)

WORLD = 2
STEPS = 6
CHECKPOINT_AT = 3
OPTIMIZERS = tuple(registry.names())
MODELS = ("mlp", "transformer")
STRATEGIES = ("ddp", "zero", "fsdp")
UPDATE_RTOL = 1e-5  # per tensor: |p_distributed − p_single| / |p_single − p_initial|
WORKER_TIMEOUT_S = 600
ELO_CLIP = 0.05  # below every step's global gradient norm here


def weights(name):
    seed = {"small_fc_lopt": 2, "velo": 3}.get(name, 4)
    return lopt.random_weights(registry.get(name).architecture, seed=seed)


def make_optimizer(name, params, **kwargs):
    kwargs.setdefault("backend", "naive")
    if name == "velo":
        return lopt.VeLO(params, num_steps=20, weights=weights(name), **kwargs)
    if name == "small_fc_lopt":
        return lopt.SmallFCLOpt(params, weights=weights(name), **kwargs)
    return registry.get(name).build(params, weights=weights(name), **kwargs)  # (with its required arguments)


def optimizer_class_and_kwargs(name, **extra):
    """For ZeroRedundancyOptimizer, which builds each process's optimizer from a class and keyword arguments."""
    if name == "velo":
        return lopt.VeLO, dict(num_steps=20, weights=weights(name), backend="naive", **extra)
    entry = registry.get(name)
    return entry.front_end_class, dict(entry.required_arguments, weights=weights(name), backend="naive", **extra)


# ------------------------------------------------------------------------------------ models and data


class MLP(torch.nn.Module):
    """Dim-0 splits over 2 processes: 9 → 5/4 rows, 5 → 3/2, 1 → 1/0 (an empty shard). The first
    weight (9, 7) factors over dim 0 (d0 = 0), the second (5, 9) has d1 = 0."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Linear(7, 9), torch.nn.Tanh(), torch.nn.Linear(9, 5),
                                          torch.nn.Tanh(), torch.nn.Linear(5, 1))

    def forward(self, batch):
        x, y = batch
        return F.mse_loss(self.layers(x).squeeze(-1), y)


class Block(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv, self.proj = torch.nn.Linear(dim, 3 * dim, bias=False), torch.nn.Linear(dim, dim)
        self.up, self.down = torch.nn.Linear(dim, 2 * dim), torch.nn.Linear(2 * dim, dim)
        # A rank-3 parameter whose factored axes are (d1, d0) = (0, 2): its row accumulator is
        # split along d1, so the row factor's normaliser spans the processes.
        self.mix = torch.nn.Parameter(torch.randn(3, 2, dim) * 0.3)

    def forward(self, h):
        q, k, v = self.qkv(self.norm1(h)).chunk(3, dim=-1)
        attention = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)
        h = h + self.proj(attention @ v)
        h = h + self.down(torch.tanh(self.up(self.norm2(h))))
        return h + 0.1 * torch.tanh(h @ self.mix.reshape(h.shape[-1], h.shape[-1]))


class TinyTransformer(torch.nn.Module):
    """Embedding (11, 6), a positional table (1, 5, 6) whose dim 0 leaves one process empty, one
    block (square (6, 6) projection: a tie of the factored axes) and a head (11, 6)."""

    def __init__(self, vocab=11, dim=6, length=5):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.position = torch.nn.Parameter(torch.randn(1, length, dim) * 0.1)
        self.block = Block(dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, batch):
        tokens, targets = batch
        logits = self.head(self.block(self.embed(tokens) + self.position))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def make_model(model_name, seed=0):
    torch.manual_seed(seed)
    return MLP() if model_name == "mlp" else TinyTransformer()


def global_batch(model_name, step):
    """The whole batch of a step (4 examples); process r of 2 trains on examples 2r, 2r + 1."""
    g = torch.Generator().manual_seed(1000 + step)
    if model_name == "mlp":
        return torch.randn(4, 7, generator=g), torch.randn(4, generator=g)
    return torch.randint(0, 11, (4, 5), generator=g), torch.randint(0, 11, (4, 5), generator=g)


def local_batch(model_name, step, rank):
    return tuple(t[2 * rank:2 * rank + 2] for t in global_batch(model_name, step))


def take_step(opt, name, loss, via_accumulate=False):
    if name != "velo":
        opt.step()
    elif via_accumulate:
        getattr(opt, "optim", opt).accumulate_loss(loss.detach())
        opt.step()
    else:
        opt.step(loss=loss.detach())


def full_parameters(model):
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}


def single_process_run(name, model_name, steps=STEPS, model=None, opt=None, first_step=0):
    """The reference: one process, the whole batch, the same initial parameters and optimizer.

    VeLO is handed the batch loss as the mean of the two half-batch losses, the number the
    processes agree on: its loss features divide differences of loss averages, which turns the
    one-ulp difference between that and the mean over all four examples into ~4e-5 of a step.
    """
    model = model or make_model(model_name)
    opt = opt or make_optimizer(name, model.parameters())
    for step in range(first_step, steps):
        opt.zero_grad()
        model(global_batch(model_name, step)).backward()
        with torch.no_grad():
            loss = torch.stack([model(local_batch(model_name, step, rank)) for rank in range(WORLD)]).mean()
        take_step(opt, name, loss)
    return full_parameters(model)


# ------------------------------------------------------------------------------------ what each process runs


def run_ddp(name, model_name, rank, **opt_kwargs):
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(make_model(model_name))
    opt = make_optimizer(name, model.parameters(), **opt_kwargs)
    for step in range(STEPS):
        opt.zero_grad()
        loss = model(local_batch(model_name, step, rank))
        loss.backward()
        take_step(opt, name, loss)
    return {"params": full_parameters(model.module), "collectives": opt.reducer.collectives / STEPS,
            "bytes": opt.reducer.bytes_reduced / STEPS}


def run_zero(name, model_name, rank, **opt_kwargs):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(make_model(model_name))
    optimizer_class, kwargs = optimizer_class_and_kwargs(name, **opt_kwargs)
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=optimizer_class, **kwargs)
    for step in range(STEPS):
        opt.zero_grad()
        loss = model(local_batch(model_name, step, rank))
        loss.backward()
        take_step(opt, name, loss, via_accumulate=True)
    return {"params": full_parameters(model.module), "tensors_here": len(opt.optim.param_groups[0]["params"]),
            "collectives": opt.optim.reducer.collectives / STEPS, "bytes": opt.optim.reducer.bytes_reduced / STEPS}


def sharded_model(model_name, seed=0):
    from torch.distributed.fsdp import fully_shard

    model = make_model(model_name, seed)
    if model_name == "transformer":
        fully_shard(model.block)
    fully_shard(model)
    return model


def run_fsdp(name, model_name, rank, steps=STEPS, model=None, opt=None, first_step=0, **opt_kwargs):
    model = model or sharded_model(model_name)
    opt = opt or make_optimizer(name, model.parameters(), **opt_kwargs)
    for step in range(first_step, steps):
        opt.zero_grad()
        loss = model(local_batch(model_name, step, rank))
        loss.backward()
        take_step(opt, name, loss)
    return model, opt


def fsdp_result(model, opt, steps=STEPS):
    layouts = {n: (tuple(p.to_local().shape), type(p).__name__) for n, p in model.named_parameters()}
    state_layouts = {n: {k: (type(v).__name__, tuple(getattr(v, "placements", ())).__repr__(),
                             tuple(v.to_local().shape) if hasattr(v, "to_local") else tuple(v.shape))
                         for k, v in opt.state[p].items()} for n, p in model.named_parameters()}
    return {"params": full_parameters(model), "local_shapes": layouts, "state_layouts": state_layouts,
            "collectives": opt.reducer.collectives / steps, "bytes": opt.reducer.bytes_reduced / steps}


def run_checkpoint(name, model_name, rank, directory):
    """Train CHECKPOINT_AT steps, save model and optimizer with torch.distributed.checkpoint, load them
    into a fresh model and optimizer (other initial values), and train on to STEPS. Also: the full
    (unsharded) state dict loads into one process's optimizer, which trains on like the single-process run."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict)

    model, opt = run_fsdp(name, model_name, rank, steps=CHECKPOINT_AT)
    full_state = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    unsharded = make_model(model_name)
    unsharded.load_state_dict(full_parameters(model))
    unsharded_opt = make_optimizer(name, unsharded.parameters(), process_group="local")
    unsharded_opt.load_state_dict(full_state)
    single_process_run(name, model_name, model=unsharded, opt=unsharded_opt, first_step=CHECKPOINT_AT)
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=directory)
    fresh = sharded_model(model_name, seed=7)
    fresh_opt = make_optimizer(name, fresh.parameters())
    state = {"model": get_model_state_dict(fresh), "optim": get_optimizer_state_dict(fresh, fresh_opt)}
    steps_before_loading = fresh_opt.param_groups[0]["step"]  # (no zero-gradient step to create the state)
    dcp.load(state, checkpoint_id=directory)
    set_model_state_dict(fresh, state["model"])
    set_optimizer_state_dict(fresh, fresh_opt, state["optim"])
    run_fsdp(name, model_name, rank, model=fresh, opt=fresh_opt, first_step=CHECKPOINT_AT)
    return {"params": full_parameters(fresh), "step": fresh_opt.param_groups[0]["step"],
            "steps_before_loading": steps_before_loading, "from_full_state_dict": full_parameters(unsharded)}


def run_nonfinite(name, strategy, rank):
    """A NaN in one gradient that only process 1's optimizer sees: both processes must skip the step."""
    if strategy == "fsdp":
        model = sharded_model("mlp")
        opt = make_optimizer(name, model.parameters())
    else:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(make_model("mlp"))
        optimizer_class, kwargs = optimizer_class_and_kwargs(name)
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=optimizer_class, **kwargs)
    before = full_parameters(model)
    loss = model(local_batch("mlp", 0, rank))
    loss.backward()
    local_opt = getattr(opt, "optim", opt)
    params = [p for group in local_opt.param_groups for p in group["params"]]
    if rank == 1:  # process 1's first local gradient element (a shard under FSDP2, a whole tensor under ZeRO)
        target = next(p for p in params if (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).numel())
        (target.grad.to_local() if hasattr(target.grad, "to_local") else target.grad).view(-1)[0] = float("nan")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        take_step(opt, name, loss)
    after = full_parameters(model)
    return {"unchanged": all(torch.equal(before[n], after[n]) for n in before),
            "skipped": local_opt.skipped_steps if hasattr(local_opt, "skipped_steps") else None,
            "warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]}


def refusals(rank):
    """Messages of the layouts and options lopt refuses (each before anything changes)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (WORLD,))
    mesh_2d = init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("replicate", "shard"))
    sharded = torch.nn.Parameter(distribute_tensor(torch.randn(4, 6), mesh, [Shard(0)]))
    cases = {
        "shard_1": lambda: [torch.nn.Parameter(distribute_tensor(torch.randn(4, 6), mesh, [Shard(1)]))],
        "replicate": lambda: [torch.nn.Parameter(distribute_tensor(torch.randn(4, 6), mesh, [Replicate()]))],
        "mesh_2d": lambda: [torch.nn.Parameter(distribute_tensor(torch.randn(4, 6), mesh_2d, [Replicate(), Shard(0)]))],
        "mixed": lambda: [sharded, torch.nn.Parameter(torch.randn(3))],
    }
    messages = {}
    for name in OPTIMIZERS:
        for case, params in cases.items():
            try:
                make_optimizer(name, params())
                messages[name, case] = None
            except (TypeError, ValueError) as err:
                messages[name, case] = str(err)
        opt = make_optimizer(name, [sharded])
        try:
            opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(3))]})
            messages[name, "mixed_later"] = None
        except TypeError as err:
            messages[name, "mixed_later"] = str(err)
        messages[name, "groups_after_refusal"] = len(opt.param_groups)
        try:
            make_optimizer(name, [sharded], process_group="local")
        except ValueError as err:
            messages[name, "local"] = str(err)
        # SmallFCLOpt's fused backend steps DTensors (on a GPU; tests/test_distributed_cuda.py), VeLO's says why not.
        messages[name, "fused_reason"] = make_optimizer(name, [sharded], backend="naive")._fused_unsupported_reason()
        # A gradient that is not sharded like its parameter is refused by the check phase.
        opt = make_optimizer(name, [sharded])
        sharded.grad = torch.randn(4, 6)
        before = sharded.full_tensor().clone()
        try:
            take_step(opt, name, torch.tensor(1.0))
        except RuntimeError as err:
            messages[name, "plain_grad"] = str(err)
        messages[name, "plain_grad_unchanged"] = torch.equal(before, sharded.full_tensor())
        sharded.grad = None
        # A state dict of plain tensors (torch.save of a one-process optimizer) is not a sharded one.
        plain = torch.nn.Parameter(sharded.full_tensor().detach().clone())
        plain_opt = make_optimizer(name, [plain])
        plain.grad = torch.ones_like(plain)
        take_step(plain_opt, name, torch.tensor(1.0))
        try:
            opt.load_state_dict(plain_opt.state_dict())
        except ValueError as err:
            messages[name, "plain_state"] = str(err)
    return messages


def fused_guard(rank):
    """The check the fused backend runs before its first multi-process step (called directly: the
    fused engines need CUDA): processes holding the same tensors pass, different tensors are refused."""
    same = make_optimizer("velo", [torch.nn.Parameter(torch.randn(4, 3))])
    same._check_fused_processes_hold_the_same_tensors()
    different = make_optimizer("velo", [torch.nn.Parameter(torch.randn(4 + rank, 3))])
    try:
        different._check_fused_processes_hold_the_same_tensors()
    except RuntimeError as err:
        return str(err)
    return None


def uneven_participation(rank):
    """ZeRO-like: each process's VeLO holds its own tensor, and process 1's has no gradient this step.
    Process 0 must step exactly like one process whose only tensor is its own (process 1 adds no row)."""
    weights_seed = torch.Generator().manual_seed(40 + rank)
    param = torch.nn.Parameter(torch.randn(5, 3, generator=weights_seed))
    twin = torch.nn.Parameter(param.detach().clone())
    opt = make_optimizer("velo", [param])
    alone = make_optimizer("velo", [twin], process_group="local")
    param.grad = torch.randn(5, 3, generator=weights_seed) if rank == 0 else None
    twin.grad = param.grad.clone() if param.grad is not None else None
    opt.step(torch.tensor(1.5))
    alone.step(torch.tensor(1.5))
    return torch.equal(param, twin)


def worker(rank, port, directory):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    results = {}
    try:
        for name in OPTIMIZERS:
            for model_name in MODELS:
                results[name, model_name, "ddp"] = run_ddp(name, model_name, rank)
                results[name, model_name, "zero"] = run_zero(name, model_name, rank)
                model, opt = run_fsdp(name, model_name, rank)
                results[name, model_name, "fsdp"] = fsdp_result(model, opt)
            results[name, "checkpoint"] = run_checkpoint(name, "transformer", rank, os.path.join(directory, name))
            results[name, "nonfinite", "fsdp"] = run_nonfinite(name, "fsdp", rank)
            results[name, "nonfinite", "zero"] = run_nonfinite(name, "zero", rank)
        results["velo", "mlp", "ddp_own_loss"] = run_ddp("velo", "mlp", rank, average_loss=False)
        results["small_fc_lopt", "mlp", "fsdp_clipped"] = fsdp_result(
            *run_fsdp("small_fc_lopt", "mlp", rank, max_grad_norm=0.05))
        if "elo" in OPTIMIZERS:  # ELO's max_grad_norm: the global norm over every tensor (and every shard)
            for model_name in MODELS:
                results["elo", model_name, "ddp_clipped"] = run_ddp("elo", model_name, rank, max_grad_norm=ELO_CLIP)
                results["elo", model_name, "zero_clipped"] = run_zero("elo", model_name, rank, max_grad_norm=ELO_CLIP)
                results["elo", model_name, "fsdp_clipped"] = fsdp_result(
                    *run_fsdp("elo", model_name, rank, max_grad_norm=ELO_CLIP))
        results["refusals"] = refusals(rank)
        results["fused_guard"] = fused_guard(rank)
        results["uneven_participation"] = uneven_participation(rank)
    except Exception:
        results["error"] = traceback.format_exc()
    torch.save(results, os.path.join(directory, f"rank{rank}.pt"))
    dist.destroy_process_group()
    leave_process()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def distributed_results():
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as directory:
        context = mp.start_processes(worker, args=(free_port(), directory), nprocs=WORLD, start_method="spawn",
                                     join=False)
        deadline = time.monotonic() + WORKER_TIMEOUT_S
        while not context.join(timeout=5):
            if time.monotonic() > deadline:  # (a collective that one process never joins would hang forever)
                for process in context.processes:
                    process.terminate()
                pytest.fail(f"the {WORLD} processes did not finish within {WORKER_TIMEOUT_S} s")
        results = [torch.load(os.path.join(directory, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]
    for rank, result in enumerate(results):
        assert "error" not in result, f"process {rank} failed:\n{result['error']}"
    return results


@pytest.fixture(scope="module")
def single_process():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    runs = {(name, model_name): single_process_run(name, model_name) for name in OPTIMIZERS for model_name in MODELS}
    initial = {model_name: full_parameters(make_model(model_name)) for model_name in MODELS}
    torch.set_num_threads(threads)
    return runs, initial


def relative_errors(got, want, initial):
    return {n: float((got[n].double() - want[n].double()).norm() / (want[n].double() - initial[n].double()).norm())
            for n in want}


# ------------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_distributed_training_equals_one_process(distributed_results, single_process, name, model_name, strategy):
    """6 steps on 2 processes (each with half of every batch) end where one process with the whole
    batches ends, for every tensor, to 1e-5 of its update — and both processes hold the same model."""
    runs, initial = single_process
    want = runs[name, model_name]
    for rank, result in enumerate(distributed_results):
        errors = relative_errors(result[name, model_name, strategy]["params"], want, initial[model_name])
        worst = max(errors, key=errors.get)
        assert errors[worst] <= UPDATE_RTOL, (rank, worst, errors[worst])
    a, b = (r[name, model_name, strategy]["params"] for r in distributed_results)
    assert all(torch.equal(a[n], b[n]) for n in a), "the processes' models differ"


def test_velo_under_ddp_without_loss_averaging_drifts(distributed_results):
    """average_loss=False: each process feeds VeLO its own loss, so the replicas no longer agree."""
    a, b = (r["velo", "mlp", "ddp_own_loss"]["params"] for r in distributed_results)
    assert any(not torch.equal(a[n], b[n]) for n in a)
    averaged = distributed_results[0]["velo", "mlp", "ddp"]["params"]
    assert any(not torch.equal(a[n], averaged[n]) for n in a)


def test_zero_partitions_the_tensors(distributed_results):
    """Each process's optimizer holds only some tensors (so the exact results above are not trivial)."""
    for model_name, total in (("mlp", 6), ("transformer", 16)):
        held = [r["velo", model_name, "zero"]["tensors_here"] for r in distributed_results]
        assert sum(held) == total and min(held) >= 1, held


def test_fsdp_shards_are_uneven_and_one_is_empty(distributed_results):
    """The sharding the FSDP2 runs used: dim 0 split as torch.chunk splits it, with empty shards."""
    shapes = [r["small_fc_lopt", "mlp", "fsdp"]["local_shapes"] for r in distributed_results]
    assert shapes[0]["layers.0.weight"] == ((5, 7), "DTensor") and shapes[1]["layers.0.weight"] == ((4, 7), "DTensor")
    assert shapes[0]["layers.4.weight"] == ((1, 5), "DTensor") and shapes[1]["layers.4.weight"] == ((0, 5), "DTensor")
    transformer = [r["velo", "transformer", "fsdp"]["local_shapes"] for r in distributed_results]
    assert transformer[1]["position"] == ((0, 5, 6), "DTensor")


def test_fsdp_state_is_sharded_like_the_parameter(distributed_results):
    """Per-element state holds the local rows (Shard(0)); the Adafactor vector that averages over
    dim 0 is whole and identical on every process (Replicate()); the LSTM rows are plain."""
    for rank, result in enumerate(distributed_results):
        layouts = result["velo", "mlp", "fsdp"]["state_layouts"]
        rows = 5 if rank == 0 else 4
        first = layouts["layers.0.weight"]  # (9, 7): VeLO's d0 = 0, d1 = 1
        assert first["mom"] == ("DTensor", "(Shard(dim=0),)", (rows, 7, 3))
        assert first["rms"] == ("DTensor", "(Shard(dim=0),)", (rows, 7, 1))
        assert first["fac_vec_row"] == ("DTensor", "(Replicate(),)", (7, 3))
        assert first["fac_vec_col"] == ("DTensor", "(Shard(dim=0),)", (rows, 3))
        assert first["lstm_hidden"] == ("Tensor", "()", (512,))
        second = layouts["layers.2.weight"]  # (5, 9): d0 = 1, d1 = 0
        assert second["fac_vec_row"] == ("DTensor", "(Shard(dim=0),)", (3 if rank == 0 else 2, 3))
        assert second["fac_vec_col"] == ("DTensor", "(Replicate(),)", (9, 3))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_sharded_checkpoint_resumes_exactly(distributed_results, name):
    """torch.distributed.checkpoint save after 3 steps, load into a fresh model and optimizer, 3 more
    steps: bit-identical to the 6 uninterrupted steps."""
    for result in distributed_results:
        resumed, uninterrupted = result[name, "checkpoint"]["params"], result[name, "transformer", "fsdp"]["params"]
        assert all(torch.equal(resumed[n], uninterrupted[n]) for n in uninterrupted)
        assert result[name, "checkpoint"]["step"] == STEPS
        assert result[name, "checkpoint"]["steps_before_loading"] == 0


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_full_state_dict_of_the_sharded_optimizer_resumes_on_one_process(distributed_results, single_process, name):
    """get_optimizer_state_dict(full_state_dict=True) after 3 sharded steps, loaded into a one-process
    optimizer (keys are parameter names), then 3 single-process steps: the single-process run's end."""
    runs, initial = single_process
    for result in distributed_results:
        errors = relative_errors(result[name, "checkpoint"]["from_full_state_dict"], runs[name, "transformer"],
                                 initial["transformer"])
        assert max(errors.values()) <= UPDATE_RTOL, errors


@pytest.mark.skipif("elo" not in OPTIMIZERS, reason="ELO is not registered")
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("model_name", MODELS)
def test_elo_clips_by_the_global_norm_like_one_process(distributed_results, model_name, strategy):
    """ELO's max_grad_norm spans every tensor: under DDP (each process holds every tensor: its own sum is the
    whole one), ZeRO (each holds some tensors: the sums add up over the processes) and FSDP2 (each holds a
    shard of every tensor) the step is one process's, clipped by the norm of all the gradients."""
    model = make_model(model_name)
    initial = full_parameters(model)
    opt = make_optimizer("elo", model.parameters(), max_grad_norm=ELO_CLIP)
    single_process_run("elo", model_name, model=model, opt=opt)
    want = full_parameters(model)
    unclipped = distributed_results[0]["elo", model_name, strategy]["params"]
    assert any(not torch.allclose(unclipped[n], want[n]) for n in want)  # the clipping mattered
    for result in distributed_results:
        errors = relative_errors(result["elo", model_name, f"{strategy}_clipped"]["params"], want, initial)
        assert max(errors.values()) <= UPDATE_RTOL, errors


def test_max_grad_norm_clips_by_the_whole_tensors_norm_under_fsdp(distributed_results):
    model = make_model("mlp")
    initial = full_parameters(model)
    opt = make_optimizer("small_fc_lopt", model.parameters(), max_grad_norm=0.05)
    for step in range(STEPS):
        opt.zero_grad()
        model(global_batch("mlp", step)).backward()
        opt.step()
    want = full_parameters(model)
    unclipped = distributed_results[0]["small_fc_lopt", "mlp", "fsdp"]["params"]
    assert any(not torch.allclose(unclipped[n], want[n]) for n in want)  # the clipping mattered
    for result in distributed_results:
        errors = relative_errors(result["small_fc_lopt", "mlp", "fsdp_clipped"]["params"], want, initial)
        assert max(errors.values()) <= UPDATE_RTOL, errors


@pytest.mark.parametrize("strategy", ["fsdp", "zero"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_nonfinite_gradient_seen_by_one_process_skips_the_step_everywhere(distributed_results, name, strategy):
    seen, unseen = (r[name, "nonfinite", strategy] for r in reversed(distributed_results))
    for result in (seen, unseen):
        assert result["unchanged"] and result["skipped"] == 1
    assert any("holds NaN" in w for w in seen["warnings"]), seen["warnings"]
    expected = "another process's shard" if strategy == "fsdp" else "of another process is not finite"
    assert any(expected in w for w in unseen["warnings"]), unseen["warnings"]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_unsupported_layouts_are_refused_with_what_is_supported(distributed_results, name):
    messages = distributed_results[0]["refusals"]
    supported = r"sharded on dim 0 over a 1-D device mesh"
    for case, pattern in (("shard_1", r"placements \(Shard\(dim=1\),\)"), ("replicate", r"placements \(Replicate\(\),\)"),
                          ("mesh_2d", r"2-D device mesh \(1, 2\) \(HSDP or tensor parallelism\)"),
                          ("mixed", r"parameter #1 \(shape \(3,\)\) is a plain tensor but parameter #0 is a DTensor"),
                          ("mixed_later", r"is a plain tensor but parameter #0 is a DTensor")):
        message = messages[name, case]
        assert message is not None, case
        assert re.search(pattern, message), (case, message)
        if case not in ("mixed", "mixed_later"):
            assert re.search(supported, message), (case, message)
    assert messages[name, "groups_after_refusal"] == 1
    assert re.search(r"process_group='local' cannot step DTensor parameters", messages[name, "local"])
    if name in ("celo2", "elo_celo2"):  # (Newton-Schulz of a split matrix: the naive backend gathers it)
        assert messages[name, "fused_reason"] == "the fused CELO2 does not step sharded (DTensor, FSDP2) parameters yet"
    else:  # (the other fused engines step FSDP2's shards)
        assert messages[name, "fused_reason"] is None
    assert re.search(r"gradient of parameter #0 is a plain tensor, but the parameter is a DTensor",
                     messages[name, "plain_grad"])
    assert messages[name, "plain_grad_unchanged"]
    assert re.search(r"parameter #0 is a DTensor but its saved state is plain tensors; save and load sharded "
                     r"\(FSDP2\) optimizer state with torch.distributed.checkpoint", messages[name, "plain_state"])


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_reductions_are_packed_not_per_tensor(distributed_results, name):
    """Collectives per step do not grow with the number of tensors (6 in the MLP, 16 in the
    transformer): one packed buffer per reduction point."""
    per_step = {(m, s): distributed_results[0][name, m, s]["collectives"] for m in MODELS for s in STRATEGIES}
    for strategy in STRATEGIES:
        assert per_step["mlp", strategy] == per_step["transformer", strategy], per_step
    small_fc = {"ddp": 1, "zero": 1, "fsdp": 3}  # check; check, accumulate, features
    celo2 = {"ddp": 1, "zero": 1, "fsdp": 5}  # check; check, accumulate, features, Newton-Schulz's gather, step
    expected = {"small_fc_lopt": small_fc, "elo": small_fc, "mulo": small_fc, "celo2": celo2, "elo_celo2": celo2,
                "velo": {"ddp": 3, "zero": 3, "fsdp": 6}}[name]  # + loss, mixing max; + two statistics passes
    assert {s: per_step["mlp", s] for s in STRATEGIES} == expected



def test_the_fused_backend_refuses_processes_that_hold_different_tensors(distributed_results):
    """Under ZeroRedundancyOptimizer the fused engines would not be exact (they do not reduce yet)."""
    for result in distributed_results:
        assert re.search(r"VeLO\(backend='fused'\): the processes' optimizers hold different parameters \(as under "
                         r"ZeroRedundancyOptimizer\).*use backend='naive' \(exact\), or DDP. Nothing was changed",
                         result["fused_guard"] or "")


def test_a_process_without_gradients_still_takes_part_in_the_controllers_max(distributed_results):
    """A process whose tensors have no gradient in a step adds no row to VeLO's max, but still joins the
    collective (else the other process would wait forever); the other steps as if alone."""
    assert all(result["uneven_participation"] for result in distributed_results)


def test_shape_fingerprint_marks_tell_same_from_different_tensors():
    """lopt.distributed's DDP-or-ZeRO test, as the processes' summed marks would read (no processes
    needed: the sums are formed here): equal fingerprints say "same", any difference says "different"."""
    from lopt import distributed

    a = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))]
    b = [torch.nn.Parameter(torch.randn(5, 3))]
    marks_a, marks_b = (distributed.same_tensors_marks(p, "cpu") for p in (a, b))
    assert marks_a.dtype == torch.float64 and 0 <= marks_a[1] < 2**20 and marks_a[2] == marks_a[1] ** 2
    assert distributed.shape_fingerprint(a) == distributed.shape_fingerprint([p.detach().clone() for p in a])
    assert bool(distributed.marks_say_same_tensors(marks_a + marks_a + marks_a))
    assert not bool(distributed.marks_say_same_tensors(marks_a + marks_a + marks_b))
    assert distributed.processes_hold_the_same_tensors(distributed.Reducer(None), a, "cpu")  # (one process)
