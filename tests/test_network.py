"""The network as data (lopt/network.py): an MLP geometry gives the weights' tensors, the packed buffer and
the kernels' constants; weights files of other geometries load from their own config."""

from __future__ import annotations

import json

import pytest
import torch

import lopt
from lopt.network import MLPGeometry, forward
from lopt.weights import WeightsError


def test_geometry_of_the_published_weights():
    geometry = MLPGeometry(39, 32, 1, 2)
    assert geometry.tensor_shapes() == {
        "network.input.weight": (32, 39), "network.input.bias": (32,),
        "network.linear_0.weight": (32, 32), "network.linear_0.bias": (32,),
        "network.output.weight": (2, 32), "network.output.bias": (2,)}
    assert geometry.config() == {"input_size": 39, "hidden_size": 32, "hidden_layers": 1}
    assert MLPGeometry.from_config(geometry.config(), outputs=2) == geometry
    assert MLPGeometry.of(lopt.random_weights("small_fc_lopt").tensors["mlp"]) == geometry


@pytest.mark.parametrize("hidden, layers", [(4, 0), (8, 2), (64, 3)])
def test_pack_offsets_and_defines_agree(hidden, layers):
    """Each tensor sits in the packed buffer at the offset the kernels are told (…_W<i>, _B<i>, the output
    layer's and the hidden-to-hidden layers' first offset plus a stride)."""
    geometry = MLPGeometry(39, hidden, layers, 2)
    network = lopt.random_weights("small_fc_lopt", seed=3, hidden_size=hidden, hidden_layers=layers).tensors["mlp"] \
        if layers else {name: torch.randn(shape) for name, shape in geometry.tensor_shapes().items()}
    packed = geometry.pack(network)
    offsets = geometry.offsets()
    assert packed.numel() == offsets["total"] == sum(t.numel() for t in network.values())
    for name, tensor in network.items():
        assert torch.equal(packed[offsets[name]:offsets[name] + tensor.numel()], tensor.reshape(-1))
    defines = dict(d.split("=", 1) for d in geometry.cuda_defines("X"))
    assert int(defines["X_HIDDEN"]) == hidden and int(defines["X_HIDDEN_LAYERS"]) == layers
    for index, (name, _, _) in enumerate(geometry.layers()):
        assert int(defines[f"X_W{index}"]) == offsets[f"network.{name}.weight"]
        assert int(defines[f"X_B{index}"]) == offsets[f"network.{name}.bias"]
    assert int(defines["X_OUTPUT_W"]) == offsets["network.output.weight"]
    for i in range(layers):
        stride = int(defines["X_LINEAR_STRIDE"])
        assert int(defines["X_LINEAR_W"]) + i * stride == offsets[f"network.linear_{i}.weight"]
        assert int(defines["X_LINEAR_B"]) + i * stride == offsets[f"network.linear_{i}.bias"]


def test_forward_is_the_layers_in_order():
    network = lopt.random_weights("small_fc_lopt", seed=5, hidden_size=8, hidden_layers=2).tensors["mlp"]
    x = torch.randn(3, 39, dtype=torch.float64)
    w = {k: v.double() for k, v in network.items()}
    h = torch.relu(x @ w["network.input.weight"].T + w["network.input.bias"])
    h = torch.relu(h @ w["network.linear_0.weight"].T + w["network.linear_0.bias"])
    h = torch.relu(h @ w["network.linear_1.weight"].T + w["network.linear_1.bias"])
    want = h @ w["network.output.weight"].T + w["network.output.bias"]
    assert torch.allclose(forward(x.float(), network).double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bad, message", [
    (dict(hidden=0), "hidden_size must be a positive integer"),
    (dict(hidden_layers=-1), "hidden_layers must be an integer >= 0"),
    (dict(hidden=512), "up to 256 hidden units"),
    (dict(hidden=8.0), "hidden_size must be a positive integer"),
])
def test_impossible_geometries_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        MLPGeometry(**{"inputs": 39, "hidden": 32, "hidden_layers": 1, "outputs": 2, **bad})


def test_weights_of_another_geometry_load_from_their_config(tmp_path):
    weights = lopt.random_weights("small_fc_lopt", seed=2, hidden_size=16, hidden_layers=3)
    assert weights.configs["mlp"] == {"input_size": 39, "hidden_size": 16, "hidden_layers": 3}
    weights.save(tmp_path / "w")
    loaded = lopt.load_weights(tmp_path / "w", "small_fc_lopt")
    assert loaded.configs == weights.configs
    assert all(torch.equal(loaded.tensors["mlp"][k], v) for k, v in weights.tensors["mlp"].items())
    # a bare .safetensors file (no config.json) describes its geometry by its tensors
    bare = lopt.load_weights(tmp_path / "w" / "model.safetensors", "small_fc_lopt")
    assert bare.configs == weights.configs


def test_a_config_that_does_not_match_its_tensors_is_refused(tmp_path):
    lopt.random_weights("small_fc_lopt", seed=2, hidden_size=16, hidden_layers=3).save(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_size": 8}))
    with pytest.raises(WeightsError, match=r"network.input.weight has shape \(16, 39\), expected \(8, 39\)"):
        lopt.load_weights(tmp_path, "small_fc_lopt")
    (tmp_path / "config.json").write_text(json.dumps({**config, "input_size": 40}))
    with pytest.raises(WeightsError, match=r"input_size=40 \(lopt needs 39\)"):
        lopt.load_weights(tmp_path, "small_fc_lopt")
    (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_layers": -2}))
    with pytest.raises(WeightsError, match="describes an MLP lopt cannot run: an MLP's hidden_layers"):
        lopt.load_weights(tmp_path, "small_fc_lopt")


def test_random_weights_choose_only_what_the_architecture_lets_weights_choose():
    with pytest.raises(WeightsError, match=r"\['hidden_size'\] cannot be chosen; velo lets weights choose nothing"):
        lopt.random_weights("velo", hidden_size=8)
    with pytest.raises(WeightsError, match=r"\['output_size'\] cannot be chosen"):
        lopt.random_weights("small_fc_lopt", output_size=3)


def test_a_safetensors_header_length_ending_in_0x80_is_not_taken_for_a_pickle(tmp_path):
    """A header of 640 bytes starts the file with 0x80 0x02, a pickle's first two bytes: lopt looked only at
    those and refused a valid file (found with a 16-unit network's file)."""
    from safetensors.torch import save_file

    tensors = lopt.random_weights("small_fc_lopt", seed=0, hidden_size=8, hidden_layers=2).tensors["mlp"]
    save_file(tensors, str(tmp_path / "w.safetensors"))
    head = (tmp_path / "w.safetensors").read_bytes()[:9]
    assert head[0] == 0x80 and 2 <= head[1] <= 5 and head[8:9] == b"{"
    loaded = lopt.load_weights(tmp_path / "w.safetensors", "small_fc_lopt")
    assert loaded.configs["mlp"]["hidden_layers"] == 2
