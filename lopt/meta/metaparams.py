"""The meta-parameters of a learned optimizer whose weights are one plain MLP, as a flat vector.

The registry (``weights/registry.json``) names each architecture's components and their exact
tensors. An architecture is meta-trainable here when it has exactly one component, ``mlp``
(small_fc_lopt: ``network.input.weight`` (32, 39), ``network.input.bias`` (32,), ...): its tensors,
in registry order, flattened and concatenated, are the vector θ the estimators perturb. VeLO (an
LSTM that writes MLP weights) is not such an architecture.
"""

from __future__ import annotations

import math

import torch

from lopt import weights as weights_lib


class MetaParamSpace:
    """θ ↔ the ``mlp`` component's tensors of ``architecture`` (float32)."""

    def __init__(self, architecture: str = "small_fc_lopt"):
        spec = weights_lib.architecture(architecture)
        if list(spec.components) != ["mlp"]:
            raise ValueError(f"lopt.meta trains architectures whose weights are one plain MLP (a single 'mlp' "
                             f"component); {architecture} has {list(spec.components)}")
        self.architecture = architecture
        self.component = spec.components["mlp"]
        self.names = list(self.component.tensors)
        self.shapes = [tuple(self.component.tensors[n]) for n in self.names]
        self.sizes = [math.prod(s) for s in self.shapes]
        self.dim = sum(self.sizes)

    def flatten(self, source) -> torch.Tensor:
        """θ (D,) from a :class:`lopt.MetaWeights`, anything ``lopt.load_weights`` takes, or a {name: tensor} dict."""
        if isinstance(source, dict) and set(source) == set(self.names):
            tensors = source
        else:
            tensors = weights_lib.load_weights(source, self.architecture).tensors["mlp"]
        return torch.cat([tensors[n].detach().to(torch.float32).reshape(-1).cpu() for n in self.names])

    def unflatten(self, theta: torch.Tensor) -> dict:
        """{name: tensor}: ``shape`` for θ of shape (D,), ``(P,) + shape`` for a population (P, D). Views of θ."""
        lead = tuple(theta.shape[:-1])
        out, offset = {}, 0
        for name, shape, size in zip(self.names, self.shapes, self.sizes):
            out[name] = theta[..., offset:offset + size].reshape(lead + shape)
            offset += size
        return out

    def to_meta_weights(self, theta: torch.Tensor, source: str = "lopt.meta") -> weights_lib.MetaWeights:
        """θ as validated :class:`lopt.MetaWeights` (``.save(dir)`` writes PyLO's hub layout)."""
        tensors = {k: v.detach().to("cpu", torch.float32).clone() for k, v in self.unflatten(theta).items()}
        raw = weights_lib.MetaWeights(self.architecture, {"mlp": tensors}, {"mlp": dict(self.component.config)},
                                      source, pretrained=True)
        return weights_lib.load_weights(raw, self.architecture)  # validates names, shapes, finiteness

    def initial(self, init="random", seed: int = 0) -> torch.Tensor:
        """θ to start meta-training from: ``"random"`` (``lopt.random_weights``, torch.nn.Linear's scale, seeded)
        or any weights source (a directory, a .safetensors file, a registered name)."""
        if init == "random":
            return self.flatten(weights_lib.random_weights(self.architecture, seed=seed))
        return self.flatten(init)
