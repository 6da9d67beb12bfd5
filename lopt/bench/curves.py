"""Loss curves: does the fused backend train like the naive one, measured against a yardstick.

Training amplifies rounding: two runs whose first steps differ in the last bits drift apart over a
few hundred steps. So the fused-vs-naive difference of loss curves means something only next to
the difference a change of the same size makes in the naive run itself. The yardstick is the
naive backend with every meta-weight tensor multiplied by ``1 + 1e-7·N(0, 1)`` (elementwise, in
float64, then rounded to float32), from the same initialisation and data.

One small GPT-2 is trained from one initialisation on a fixed token stream (a sparse Markov
chain), once per run: naive, the contender (fused; on a CPU, or wherever fused cannot run, the
naive step under ``torch.compile``), and the nudged naive yardstick. Reported per run: the loss at
each step and the largest relative difference from the naive run, ``max_t |L(t) − L_naive(t)| / L_naive(t)``.
"""

from __future__ import annotations

import contextlib
import math

import torch

from lopt.bench.contenders import make_contender, short_reason
from lopt.bench.models import build_model, markov_token_stream
from lopt.weights import MetaWeights

NUDGE_RELATIVE = 1e-7
NUDGE_SEED = 12345
NUDGED_RUN = "naive, nudged meta-weights"
MODEL_SEED = 0
DATA_SEED = 0


def nudged_weights(weights: MetaWeights, relative: float = NUDGE_RELATIVE, seed: int = NUDGE_SEED) -> MetaWeights:
    """``weights`` with each tensor multiplied by ``1 + relative·N(0, 1)`` elementwise (in float64)."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for component, named in weights.tensors.items():
        tensors[component] = {}
        for name, tensor in named.items():
            noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float64)
            tensors[component][name] = (tensor.detach().cpu().double() * (1 + relative * noise)).to(torch.float32)
    return MetaWeights(weights.architecture, tensors, dict(weights.configs),
                       f"{weights.source}, nudged by {relative:g} relative", weights.pretrained)


def max_relative_difference(losses, reference) -> float | None:
    """``max_t |losses[t] − reference[t]| / |reference[t]|``; None when a loss is not finite."""
    values = torch.tensor(losses, dtype=torch.float64)
    ref = torch.tensor(reference, dtype=torch.float64)
    if not (torch.isfinite(values).all() and torch.isfinite(ref).all()):
        return None
    return float(((values - ref).abs() / ref.abs().clamp_min(1e-30)).max())


def train_losses(model_name: str, optimizer_name: str, contender_name: str, weights, stream, *, steps: int,
                 device: torch.device, batch_size: int, seq_len: int, progress=None, options: dict | None = None) -> list:
    """The training loss at each of ``steps`` steps of one run (same initialisation and batches every run)."""
    model = build_model(model_name, device, batch_size=batch_size, seq_len=seq_len, seed=MODEL_SEED, attention="eager")
    contender = make_contender(optimizer_name, contender_name, model.parameters(), weights, device, num_steps=steps,
                               options=options)
    autocast = (torch.autocast(device_type="cuda", dtype=torch.bfloat16) if device.type == "cuda"
                else contextlib.nullcontext())
    losses = []
    for step in range(steps):
        tokens = stream[step * batch_size:(step + 1) * batch_size]
        contender.optimizer.zero_grad(set_to_none=True)
        with autocast:
            loss = model.loss(tokens)
        loss.backward()
        contender.step(loss.detach())
        losses.append(loss.detach().float())
        if progress is not None:
            progress.update(1)
    return torch.stack(losses).cpu().tolist()


def curves_contender(device: torch.device, requested: str | None) -> tuple[str, str]:
    """The contender whose curve is compared with naive, and why it is that one."""
    if requested is not None:
        return requested, "chosen with --curves-contender"
    if device.type == "cuda":
        return "fused", "the fused backend on CUDA"
    return "naive+compile", ("no fused backend without CUDA, so naive is compared with the naive step under "
                             "torch.compile (the same math, its rounding reordered like a fused kernel's)")


def loss_curves(optimizer_names, weights_by_optimizer: dict, model_name: str, *, steps: int, device: torch.device,
                contender: str, why: str, unavailable: dict, batch_size: int | None = None, seq_len: int | None = None,
                make_progress=None, say=print, options: dict | None = None) -> dict:
    """Train the runs of every optimizer; the curves, their differences and the settings (the JSON's ``curves``).

    ``unavailable[optimizer]`` is the reason ``contender`` cannot run for it (None: it can). ``options``:
    hyperparameters every learned run gets (default: the optimizer's own, lr 1).
    """
    from lopt.param_sets import model_spec

    spec = model_spec(model_name)
    batch_size = batch_size or spec.batch_size
    seq_len = seq_len or spec.seq_len
    stream = markov_token_stream(spec.config["vocab_size"], steps * batch_size, seq_len, seed=DATA_SEED).to(device)
    record = {"model": model_name, "description": spec.description, "steps": steps, "batch_size": batch_size,
              "seq_len": seq_len, "autocast": "bfloat16" if device.type == "cuda" else None,
              "nudge": {"relative": NUDGE_RELATIVE, "seed": NUDGE_SEED}, "contender": contender, "why": why,
              "options": dict(options or {}), "optimizers": {}}
    for optimizer_name in optimizer_names:
        weights = weights_by_optimizer[optimizer_name]
        runs = [("naive", "naive", weights)]
        reason = unavailable.get(optimizer_name)
        if reason is None:
            runs.append((contender, contender, weights))
        else:
            say(f"curves: {optimizer_name} {contender} unavailable ({reason}): drawing naive and the yardstick only")
        runs.append((NUDGED_RUN, "naive", nudged_weights(weights)))
        losses = {}
        for label, contender_name, run_weights in runs:
            bar = make_progress(steps, f"curves {optimizer_name} {label}") if make_progress else None
            try:
                losses[label] = train_losses(model_name, optimizer_name, contender_name, run_weights, stream,
                                             steps=steps, device=device, batch_size=batch_size, seq_len=seq_len,
                                             progress=bar, options=options)
            except Exception as err:  # e.g. torch.compile failing on this platform
                if label != contender:
                    raise
                reason = f"{type(err).__name__}: {short_reason(err)}"
                say(f"curves: {optimizer_name} {contender} failed ({reason})")
            finally:
                if bar is not None:
                    bar.close()
        differences = {label: max_relative_difference(values, losses["naive"])
                       for label, values in losses.items() if label != "naive"}
        record["optimizers"][optimizer_name] = {
            "weights": weights.source, "pretrained": weights.pretrained, "contender_unavailable": reason,
            "losses": losses, "max_rel_diff_vs_naive": differences}
    return record


def describe_difference(value) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "not finite"
    return f"{100 * value:.3g}%"
