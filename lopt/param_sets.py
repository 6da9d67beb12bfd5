"""Real models for the benchmarks: their parameter shapes (no model code needed) and how to build them.

Each entry of :data:`MODELS` describes one model. ``lopt bench --mode step`` needs only its
parameter shapes, listed here as ``(name, shape)`` in the model's own parameter order and derived
from its config: GPT-2 as ``transformers.GPT2LMHeadModel`` builds it (Conv1D weights are
``(in, out)``; the LM head is tied to ``wte``), ViT-B/16 as ``timm``'s ``vit_base_patch16_224``, ResNet-50 as
``timm``'s ``resnet50`` (conv kernels: CELO2's sliced tensors).
``lopt bench --mode iteration`` and ``--curves`` build the model itself (``lopt.bench.models``).

:func:`embedding_flags` marks the tensors ``lopt.param_groups_for`` routes to CELO2's AdamW branch on the
built model, so that ``lopt bench`` routes the bare tensors of step mode as training would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class ModelSpec:
    """A benchmark model: its family (``gpt2``, ``vit``, ``resnet`` or ``toy-lm``), hyperparameters and default
    batch."""

    family: str
    config: dict = field(default_factory=dict)
    batch_size: int = 8
    seq_len: int | None = None  # language models: tokens per sequence (≤ n_positions)
    description: str = ""

    @property
    def is_language_model(self) -> bool:
        return self.family in ("gpt2", "toy-lm")

    @property
    def is_image_model(self) -> bool:
        """An image classifier built by timm (``config["timm_name"]``), trained on random images."""
        return self.family in ("vit", "resnet")


def gpt2_config(n_embd: int, n_layer: int, n_head: int, vocab_size: int = 50257, n_positions: int = 1024) -> dict:
    return dict(n_embd=n_embd, n_layer=n_layer, n_head=n_head, vocab_size=vocab_size, n_positions=n_positions)


MODELS = {
    "gpt2-small": ModelSpec("gpt2", gpt2_config(768, 12, 12), 8, 1024, "GPT-2 small (124 M)"),
    "gpt2-medium": ModelSpec("gpt2", gpt2_config(1024, 24, 16), 8, 1024, "GPT-2 medium (355 M)"),
    "vit-b16": ModelSpec("vit", dict(timm_name="vit_base_patch16_224", embed_dim=768, depth=12, patch=16, image=224,
                                     num_classes=1000), 64, None, "ViT-B/16 at 224x224 (86.6 M)"),
    "resnet50": ModelSpec("resnet", dict(timm_name="resnet50", image=224, num_classes=1000), 64, None,
                          "ResNet-50 at 224x224 (25.6 M)"),
    # GPT-2's layout at a size a 2-core CPU steps in well under a second (the CPU default).
    "tiny-lm": ModelSpec("gpt2", gpt2_config(128, 2, 4, vocab_size=1024, n_positions=256), 8, 128,
                         "2-layer 128-wide GPT-2 (0.6 M)"),
    # The loss-curve models: a few-layer GPT-2 (CUDA default) and a one-layer one (CPU default).
    "gpt2-4x256": ModelSpec("gpt2", gpt2_config(256, 4, 4, vocab_size=4096, n_positions=256), 16, 256,
                            "4-layer 256-wide GPT-2 (4.3 M)"),
    "gpt2-1x64": ModelSpec("gpt2", gpt2_config(64, 1, 2, vocab_size=256, n_positions=64), 8, 64,
                           "1-layer 64-wide GPT-2 (70 k)"),
    # Three tensors (embedding, output projection, bias): a bigram language model in plain torch,
    # for tests of the compiled contender, whose compile time grows with the number of tensors.
    "toy-lm": ModelSpec("toy-lm", dict(vocab_size=256, width=32), 8, 32, "bigram LM, 3 tensors (16 k)"),
}


def gpt2_shapes(n_embd: int, n_layer: int, vocab_size: int = 50257, n_positions: int = 1024, **_) -> list:
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
               mlp_ratio: int = 4, **_) -> list:
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


def resnet_shapes(layers=(3, 4, 6, 3), widths=(64, 128, 256, 512), expansion: int = 4, stem: int = 64,
                  num_classes: int = 1000, **_) -> list:
    """timm's bottleneck ResNet (``resnet50``): a 7 x 7 stem, stages of 1 x 1, 3 x 3, 1 x 1 convolutions with
    batch norms, a 1 x 1 downsample at each stage's first block, the classifier."""
    shapes = [("conv1.weight", (stem, 3, 7, 7)), ("bn1.weight", (stem,)), ("bn1.bias", (stem,))]
    inplanes = stem
    for stage, (blocks, width) in enumerate(zip(layers, widths), start=1):
        out = width * expansion
        for block in range(blocks):
            prefix = f"layer{stage}.{block}."
            for index, (channels_in, channels_out, kernel) in enumerate([(inplanes, width, 1), (width, width, 3),
                                                                         (width, out, 1)], start=1):
                shapes += [(prefix + f"conv{index}.weight", (channels_out, channels_in, kernel, kernel)),
                           (prefix + f"bn{index}.weight", (channels_out,)), (prefix + f"bn{index}.bias", (channels_out,))]
            if block == 0:
                shapes += [(prefix + "downsample.0.weight", (out, inplanes, 1, 1)),
                           (prefix + "downsample.1.weight", (out,)), (prefix + "downsample.1.bias", (out,))]
            inplanes = out
    return shapes + [("fc.weight", (num_classes, inplanes)), ("fc.bias", (num_classes,))]


def toy_lm_shapes(vocab_size: int, width: int) -> list:
    return [("embedding.weight", (vocab_size, width)), ("head.weight", (vocab_size, width)),
            ("head.bias", (vocab_size,))]


_SHAPES_BY_FAMILY = {"gpt2": gpt2_shapes, "vit": vit_shapes, "resnet": resnet_shapes, "toy-lm": toy_lm_shapes}

# Parameter sets by name (a callable returning the shapes, as before ModelSpec existed).
PARAM_SETS = {name: (lambda spec=spec: _SHAPES_BY_FAMILY[spec.family](**spec.config)) for name, spec in MODELS.items()}


def model_spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown parameter set {name!r}; known: {', '.join(MODELS)}") from None


def param_set_shapes(name: str) -> list:
    spec = model_spec(name)
    return _SHAPES_BY_FAMILY[spec.family](**spec.config)


def param_set_numel(name: str) -> int:
    return sum(math.prod(shape) for _, shape in param_set_shapes(name))


# Parameters of torch.nn.Embedding modules, whose names do not say "embed" (GPT-2's wte and wpe).
EMBEDDING_MODULE_PARAMETERS = {"gpt2": ("transformer.wte.weight", "transformer.wpe.weight"),
                               "toy-lm": ("embedding.weight",)}


def embedding_flags(name: str) -> list:
    """Per tensor of the set (in its order): whether ``lopt.param_groups_for`` puts it in the ``is_embedding``
    group on the built model (a name containing "embed", or a parameter of an Embedding module)."""
    modules = EMBEDDING_MODULE_PARAMETERS.get(model_spec(name).family, ())
    return [tensor in modules or "embed" in tensor for tensor, _ in param_set_shapes(name)]


def build_parameters(name: str, device="cpu", dtype=torch.float32, seed: int = 0) -> list:
    """Parameters of the set's shapes, drawn N(0, 0.02²) (as GPT-2 initialises its weights)."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(shape, generator=generator) * 0.02).to(device=device, dtype=dtype))
            for _, shape in param_set_shapes(name)]
