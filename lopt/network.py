"""The per-element network of an MLP learned optimizer, as data.

A learned optimizer such as small_fc_lopt applies one small MLP to every parameter element. Its
geometry — inputs, hidden width, number of hidden layers, outputs — is read from the weights' own
``config.json`` (PyLO's ``MetaMLP`` arguments), and everything else follows from it here, once:

* the tensors a weights file must hold and their shapes (``lopt.weights`` validates against them);
* the naive forward pass (:func:`forward`, used by the reference modules);
* the flat float32 buffer the fused kernels read and the offsets of each layer in it
  (:meth:`MLPGeometry.pack`, :meth:`MLPGeometry.offsets`);
* the compile-time constants of the kernels (:meth:`MLPGeometry.cuda_defines`), so that the CUDA
  code is specialised to this geometry and nothing is mirrored by hand.

PyLO counts hidden layers as the hidden-to-hidden layers after the input layer: its
``hidden_layers=1`` is ``input`` (in → h), ``linear_0`` (h → h), ``output`` (h → out), which
learned_optimization's JAX code calls ``hidden_layers=2``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

PREFIX = "network."
# What the fused kernels are built for (a register array per thread holds a hidden layer).
MAX_HIDDEN = 256
MAX_HIDDEN_LAYERS = 8
CONFIG_NAMES = {"inputs": "input_size", "hidden": "hidden_size", "outputs": "output size"}


@dataclass(frozen=True)
class MLPGeometry:
    """An MLP ``inputs → hidden (× 1 + hidden_layers) → outputs`` with ReLU between layers."""

    inputs: int
    hidden: int
    hidden_layers: int
    outputs: int

    def __post_init__(self):
        for name in ("inputs", "hidden", "outputs"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"an MLP's {CONFIG_NAMES[name]} must be a positive integer, got {value!r}")
        if not isinstance(self.hidden_layers, int) or isinstance(self.hidden_layers, bool) or self.hidden_layers < 0:
            raise ValueError(f"an MLP's hidden_layers must be an integer >= 0, got {self.hidden_layers!r}")
        if self.hidden > MAX_HIDDEN or self.hidden_layers > MAX_HIDDEN_LAYERS:
            raise ValueError(f"lopt runs MLPs of up to {MAX_HIDDEN} hidden units and {MAX_HIDDEN_LAYERS} hidden layers, "
                             f"got hidden_size={self.hidden}, hidden_layers={self.hidden_layers}")

    @classmethod
    def from_config(cls, config: dict, outputs: int) -> "MLPGeometry":
        """From PyLO's ``config.json`` (``input_size``, ``hidden_size``, ``hidden_layers``)."""
        return cls(inputs=config["input_size"], hidden=config["hidden_size"], hidden_layers=config["hidden_layers"],
                   outputs=outputs)

    @classmethod
    def of(cls, network: dict) -> "MLPGeometry":
        """The geometry of a dict of the network's tensors (PyTorch ``out × in`` weights)."""
        first = network[PREFIX + "input.weight"]
        last = network[PREFIX + "output.weight"]
        hidden_layers = sum(1 for name in network if name.startswith(PREFIX + "linear_") and name.endswith(".weight"))
        return cls(inputs=int(first.shape[1]), hidden=int(first.shape[0]), hidden_layers=hidden_layers,
                   outputs=int(last.shape[0]))

    def config(self) -> dict:
        return {"input_size": self.inputs, "hidden_size": self.hidden, "hidden_layers": self.hidden_layers}

    def layers(self) -> list[tuple[str, int, int]]:
        """``(name, out, in)`` of each linear layer in order: ``input``, ``linear_0`` ..., ``output``."""
        return ([("input", self.hidden, self.inputs)]
                + [(f"linear_{i}", self.hidden, self.hidden) for i in range(self.hidden_layers)]
                + [("output", self.outputs, self.hidden)])

    def tensor_shapes(self) -> dict:
        """The weights file's tensors: ``network.<layer>.weight`` (out, in) and ``.bias`` (out,)."""
        shapes = {}
        for name, out, inp in self.layers():
            shapes[f"{PREFIX}{name}.weight"] = (out, inp)
            shapes[f"{PREFIX}{name}.bias"] = (out,)
        return shapes

    def offsets(self) -> dict:
        """Offset (in floats) of each tensor in :meth:`pack`'s buffer, and ``"total"``."""
        offsets, position = {}, 0
        for name, shape in self.tensor_shapes().items():
            offsets[name] = position
            position += shape[0] * (shape[1] if len(shape) > 1 else 1)
        offsets["total"] = position
        return offsets

    def pack(self, network: dict) -> torch.Tensor:
        """Every tensor in :meth:`tensor_shapes` order, flattened (row-major ``out × in``), float32, on the CPU."""
        return torch.cat([network[name].detach().cpu().to(torch.float32).reshape(-1) for name in self.tensor_shapes()])

    def cuda_defines(self, prefix: str) -> tuple:
        """The kernels' constants for this geometry, ``PREFIX_NAME=value``: the widths and the packed buffer's
        length (``..._FLOATS``); the offset of each
        layer's weight and bias in the packed buffer (``..._W<i>``/``..._B<i>``, layer i = 0 ... hidden_layers + 1);
        and for loops over the layers, the output layer's (``..._OUTPUT_W``/``_B``) and the hidden-to-hidden
        layers' as the first one's plus a stride (``..._LINEAR_W``/``_B``, ``..._LINEAR_STRIDE``)."""
        offsets = self.offsets()
        defines = [f"{prefix}_INPUTS={self.inputs}", f"{prefix}_HIDDEN={self.hidden}",
                   f"{prefix}_HIDDEN_LAYERS={self.hidden_layers}", f"{prefix}_OUTPUTS={self.outputs}",
                   f"{prefix}_FLOATS={offsets['total']}"]
        for index, (name, _, _) in enumerate(self.layers()):
            defines += [f"{prefix}_W{index}={offsets[f'{PREFIX}{name}.weight']}",
                        f"{prefix}_B{index}={offsets[f'{PREFIX}{name}.bias']}"]
        defines += [f"{prefix}_OUTPUT_W={offsets[PREFIX + 'output.weight']}",
                    f"{prefix}_OUTPUT_B={offsets[PREFIX + 'output.bias']}"]
        first_linear = PREFIX + "linear_0"
        defines += [f"{prefix}_LINEAR_W={offsets.get(first_linear + '.weight', 0)}",
                    f"{prefix}_LINEAR_B={offsets.get(first_linear + '.bias', 0)}",
                    f"{prefix}_LINEAR_STRIDE={self.hidden * self.hidden + self.hidden}"]
        return tuple(defines)


def forward(inputs: torch.Tensor, network: dict) -> torch.Tensor:
    """The MLP on ``inputs`` (``... × in``): ReLU after every layer but the last; returns ``... × out``."""
    geometry = MLPGeometry.of(network)
    hidden = inputs
    for name, _, _ in geometry.layers()[:-1]:
        hidden = F.relu(F.linear(hidden, network[f"{PREFIX}{name}.weight"], network[f"{PREFIX}{name}.bias"]))
    return F.linear(hidden, network[PREFIX + "output.weight"], network[PREFIX + "output.bias"])
