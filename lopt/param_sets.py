"""Parameter shapes of real models, for benchmarks (no model code or download needed).

Each set lists ``(name, shape)`` in the models' own parameter order, derived from their configs:
GPT-2 as ``transformers.GPT2LMHeadModel`` builds it (Conv1D weights are ``(in, out)``; the LM
head is tied to ``wte``), ViT-B/16 as ``timm``'s ``vit_base_patch16_224``.
"""

from __future__ import annotations

import math

import torch


def gpt2_shapes(n_embd: int, n_layer: int, vocab_size: int = 50257, n_positions: int = 1024) -> list:
    shapes = [("transformer.wte.weight", (vocab_size, n_embd)), ("transformer.wpe.weight", (n_positions, n_embd))]
    for layer in range(n_layer):
        prefix = f"transformer.h.{layer}."
        shapes += [
            (prefix + "ln_1.weight", (n_embd,)), (prefix + "ln_1.bias", (n_embd,)),
            (prefix + "attn.c_attn.weight", (n_embd, 3 * n_embd)), (prefix + "attn.c_attn.bias", (3 * n_embd,)),
            (prefix + "attn.c_proj.weight", (n_embd, n_embd)), (prefix + "attn.c_proj.bias", (n_embd,)),
            (prefix + "ln_2.weight", (n_embd,)), (prefix + "ln_2.bias", (n_embd,)),
            (prefix + "mlp.c_fc.weight", (n_embd, 4 * n_embd)), (prefix + "mlp.c_fc.bias", (4 * n_embd,)),
            (prefix + "mlp.c_proj.weight", (4 * n_embd, n_embd)), (prefix + "mlp.c_proj.bias", (n_embd,)),
        ]
    return shapes + [("transformer.ln_f.weight", (n_embd,)), ("transformer.ln_f.bias", (n_embd,))]


def vit_shapes(embed_dim: int = 768, depth: int = 12, patch: int = 16, image: int = 224, num_classes: int = 1000,
               mlp_ratio: int = 4) -> list:
    tokens = (image // patch) ** 2 + 1
    shapes = [("cls_token", (1, 1, embed_dim)), ("pos_embed", (1, tokens, embed_dim)),
              ("patch_embed.proj.weight", (embed_dim, 3, patch, patch)), ("patch_embed.proj.bias", (embed_dim,))]
    hidden = mlp_ratio * embed_dim
    for block in range(depth):
        prefix = f"blocks.{block}."
        shapes += [
            (prefix + "norm1.weight", (embed_dim,)), (prefix + "norm1.bias", (embed_dim,)),
            (prefix + "attn.qkv.weight", (3 * embed_dim, embed_dim)), (prefix + "attn.qkv.bias", (3 * embed_dim,)),
            (prefix + "attn.proj.weight", (embed_dim, embed_dim)), (prefix + "attn.proj.bias", (embed_dim,)),
            (prefix + "norm2.weight", (embed_dim,)), (prefix + "norm2.bias", (embed_dim,)),
            (prefix + "mlp.fc1.weight", (hidden, embed_dim)), (prefix + "mlp.fc1.bias", (hidden,)),
            (prefix + "mlp.fc2.weight", (embed_dim, hidden)), (prefix + "mlp.fc2.bias", (embed_dim,)),
        ]
    return shapes + [("norm.weight", (embed_dim,)), ("norm.bias", (embed_dim,)),
                     ("head.weight", (num_classes, embed_dim)), ("head.bias", (num_classes,))]


PARAM_SETS = {
    "gpt2-small": lambda: gpt2_shapes(768, 12),
    "gpt2-medium": lambda: gpt2_shapes(1024, 24),
    "vit-b16": vit_shapes,
    # GPT-2's layout at a size a 2-core CPU steps in well under a second (the CPU default).
    "tiny-lm": lambda: gpt2_shapes(128, 2, vocab_size=1024, n_positions=256),
}


def param_set_shapes(name: str) -> list:
    try:
        return PARAM_SETS[name]()
    except KeyError:
        raise ValueError(f"unknown parameter set {name!r}; known: {sorted(PARAM_SETS)}") from None


def param_set_numel(name: str) -> int:
    return sum(math.prod(shape) for _, shape in param_set_shapes(name))


def build_parameters(name: str, device="cpu", dtype=torch.float32, seed: int = 0) -> list:
    """Parameters of the set's shapes, drawn N(0, 0.02²) (as GPT-2 initialises its weights)."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(shape, generator=generator) * 0.02).to(device=device, dtype=dtype))
            for _, shape in param_set_shapes(name)]
