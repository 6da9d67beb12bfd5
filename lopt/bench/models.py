"""The real models ``lopt bench --mode iteration`` and ``--curves`` train: built from configs, random init.

GPT-2 comes from ``transformers`` (``GPT2LMHeadModel(GPT2Config(...))``), ViT-B/16 from ``timm``
(``create_model(..., pretrained=False)``): nothing is downloaded. Both libraries are optional (the
``bench`` extra); a missing one is reported by :func:`require_model_libraries` as one line.
Dropout is off, so that a model's loss depends only on its parameters and its batch.
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass
from typing import Callable

import torch

from lopt.param_sets import ModelSpec, model_spec


class BenchSetupError(RuntimeError):
    """A benchmark cannot start (a missing library, an impossible option); the message is one line."""


# The library each model family needs, and how to get it.
_LIBRARIES = {
    "gpt2": ("transformers", "pip install -e '.[bench]' in the lopt checkout (or pip install transformers)"),
    "vit": ("timm", "pip install timm (it needs a torchvision built for your torch: install both from the same index)"),
}
_LIBRARIES["resnet"] = _LIBRARIES["vit"]


def _import_problem(module: str) -> str | None:
    """None if ``module`` imports, else the reason in one line (an ImportError or a broken dependency)."""
    try:
        importlib.import_module(module)
    except Exception as err:  # e.g. timm's torchvision built for another torch raises RuntimeError
        first_line = (str(err).strip().splitlines() or [""])[0]
        return f"{type(err).__name__}: {first_line}"
    return None


def require_model_libraries(model_names, what: str) -> None:
    """Raise :class:`BenchSetupError` (one line) if a library that one of ``model_names`` needs does not import."""
    for name in model_names:
        family = model_spec(name).family
        if family not in _LIBRARIES:
            continue
        module, how = _LIBRARIES[family]
        problem = _import_problem(module)
        if problem is not None:
            raise BenchSetupError(f"{what} with {name} needs {module}, which cannot be imported ({problem}); {how}")


def require_matplotlib(option: str) -> None:
    problem = _import_problem("matplotlib")
    if problem is not None:
        raise BenchSetupError(f"{option} needs matplotlib, which cannot be imported ({problem}); "
                              f"pip install -e '.[bench]' in the lopt checkout (or pip install matplotlib)")


@dataclass
class BenchModel:
    """A model on its device, a fixed batch maker and its training loss."""

    name: str
    spec: ModelSpec
    module: torch.nn.Module
    batch_size: int
    seq_len: int | None
    loss: Callable  # loss(batch) -> scalar tensor

    def parameters(self) -> list:
        return list(self.module.parameters())

    def random_batch(self, seed: int = 0):
        """One batch of random inputs (token ids, or images and labels), made on the CPU, on the model's device."""
        generator = torch.Generator().manual_seed(seed)
        device = next(self.module.parameters()).device
        if self.spec.is_image_model:
            image = self.spec.config["image"]
            images = torch.randn((self.batch_size, 3, image, image), generator=generator)
            labels = torch.randint(self.spec.config["num_classes"], (self.batch_size,), generator=generator)
            return images.to(device), labels.to(device)
        tokens = torch.randint(self.spec.config["vocab_size"], (self.batch_size, self.seq_len), generator=generator)
        return tokens.to(device)


class BigramLM(torch.nn.Module):
    """The ``toy-lm`` model: each token's embedding predicts the next token through one linear layer."""

    def __init__(self, vocab_size: int, width: int):
        super().__init__()
        self.embedding = torch.nn.Embedding(vocab_size, width)
        self.head = torch.nn.Linear(width, vocab_size)
        torch.nn.init.normal_(self.embedding.weight, std=0.02)
        torch.nn.init.normal_(self.head.weight, std=0.02)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, tokens):
        return self.head(self.embedding(tokens))


def _next_token_loss(logits, tokens):
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                             tokens[:, 1:].reshape(-1))


@contextlib.contextmanager
def _quiet_transformers():
    """Silence transformers' config notices while building (restored afterwards)."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def _build_module(spec: ModelSpec, attention: str | None) -> tuple[torch.nn.Module, Callable]:
    if spec.family == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        vocab = spec.config["vocab_size"]
        with _quiet_transformers():
            config = GPT2Config(**spec.config, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                                bos_token_id=vocab - 1, eos_token_id=vocab - 1)
            if attention is not None:
                config._attn_implementation = attention
            module = GPT2LMHeadModel(config)
        return module, lambda model, tokens: _next_token_loss(model(input_ids=tokens).logits, tokens)
    if spec.is_image_model:
        import timm

        module = timm.create_model(spec.config["timm_name"], pretrained=False, num_classes=spec.config["num_classes"])
        return module, lambda model, batch: torch.nn.functional.cross_entropy(model(batch[0]).float(), batch[1])
    if spec.family == "toy-lm":
        module = BigramLM(spec.config["vocab_size"], spec.config["width"])
        return module, lambda model, tokens: _next_token_loss(model(tokens), tokens)
    raise ValueError(f"unknown model family {spec.family!r}")


def build_model(name: str, device, *, batch_size: int | None = None, seq_len: int | None = None, seed: int = 0,
                attention: str | None = None) -> BenchModel:
    """The model ``name`` on ``device``, float32, initialised from ``seed`` (the global RNG is left as it was).

    ``attention`` picks transformers' attention implementation (e.g. ``"eager"``, deterministic);
    None keeps its default.
    """
    spec = model_spec(name)
    device = torch.device(device)
    # Built and initialised on the device itself (GPT-2 medium's random init is slow on a CPU).
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), device:
        torch.manual_seed(seed)
        module, loss = _build_module(spec, attention)
    module = module.to(device=device, dtype=torch.float32).train()
    return BenchModel(name, spec, module, batch_size or spec.batch_size, seq_len or spec.seq_len,
                      lambda batch: loss(module, batch))


def markov_token_stream(vocab_size: int, rows: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    """A fixed token stream with structure to learn: ``rows`` sequences of a random sparse Markov chain.

    Each token has four possible successors (probabilities 0.55, 0.25, 0.15, 0.05), so a model can
    bring the loss from log(vocab) down towards the chain's entropy (about 1.1 nats).
    """
    generator = torch.Generator().manual_seed(seed)
    successors = torch.randint(vocab_size, (vocab_size, 4), generator=generator)
    choice_probs = torch.tensor([0.55, 0.25, 0.15, 0.05])
    stream = torch.empty((rows, seq_len), dtype=torch.long)
    stream[:, 0] = torch.randint(vocab_size, (rows,), generator=generator)
    choices = torch.multinomial(choice_probs, rows * seq_len, replacement=True, generator=generator).view(rows, seq_len)
    for position in range(1, seq_len):
        stream[:, position] = successors[stream[:, position - 1], choices[:, position]]
    return stream
