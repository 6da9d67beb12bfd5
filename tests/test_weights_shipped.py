"""lopt's own weights, shipped inside the package (weights/lopt-small_fc-tiny/, issue #43 item 6).

They load from lopt's files, never from the hub: offline, with an empty Hugging Face cache and an
unreachable hub; their files match the registry's sha256; and they train: 100 steps of an MLP on
lopt's offline mnist1d data (64-64, twice the width of the meta-training family) bring the loss down
by a clear margin, far more than untrained weights and AdamW at 1e-3.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import lopt
from hub_server import closed_port_endpoint
from lopt import weights as W
from lopt.cli import main as cli_main

NAME = "lopt-small_fc-tiny"
REPO_ROOT = Path(__file__).resolve().parent.parent


def test_registered_as_shipped_and_the_files_match_the_registry():
    entry = W.registered_weights()[NAME]
    assert entry.architecture == "small_fc_lopt"
    (component,) = entry.components.values()
    assert component.shipped and component.repo_id is None and component.path == NAME
    assert component.directory() == REPO_ROOT / "weights" / NAME  # the source tree (an editable install)
    assert set(component.files) == {"config.json", "model.safetensors"}
    for filename, expected in component.files.items():
        data = (component.directory() / filename).read_bytes()
        assert len(data) == expected["size"] and hashlib.sha256(data).hexdigest() == expected["sha256"], filename
    record = json.loads((component.directory() / "record.json").read_text())
    sha = hashlib.sha256((component.directory() / "model.safetensors").read_bytes()).hexdigest()
    assert record["weights"]["model.safetensors sha256"] == sha
    assert W.shipped_weights("small_fc_lopt") == [NAME] and W.shipped_weights("velo") == []
    # pyproject.toml's package data ships them inside lopt/_registry (a wheel built from it lists them)
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    patterns = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["lopt._registry"]
    for filename in ("config.json", "model.safetensors", "record.json"):
        assert any(Path(NAME, filename).match(p) for p in patterns), (filename, patterns)


def test_loads_offline_with_an_empty_cache(offline_hub):
    assert W.cached_status(NAME) == "shipped"
    loaded = W.load_weights(NAME, "small_fc_lopt")
    assert loaded.pretrained and loaded.source == f"{NAME} (lopt/_registry/{NAME} (ships with lopt))"
    assert not any(offline_hub.cache.iterdir())  # nothing went through the hub's cache
    assert W.download(NAME) == [REPO_ROOT / "weights" / NAME]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # trained weights: no UntrainedWeightsWarning
        opt = lopt.SmallFCLOpt([torch.zeros(3, requires_grad=True)], weights=NAME, backend="naive")
    assert torch.equal(opt.meta_weights.tensors["mlp"]["network.input.weight"],
                       loaded.tensors["mlp"]["network.input.weight"])


def test_a_fresh_process_offline_with_an_unreachable_hub(tmp_path):
    """A fresh machine: empty HF_HOME, HF_HUB_OFFLINE=1, and an endpoint nothing listens on."""
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1",
           "HF_ENDPOINT": closed_port_endpoint()}
    code = ("import torch, lopt; p = torch.nn.Parameter(torch.ones(4, 3)); "
            f"opt = lopt.SmallFCLOpt([p], weights={NAME!r}, backend='naive'); p.grad = torch.ones(4, 3); opt.step(); "
            "print(opt.meta_weights.source, bool((p != 1).any()))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"{NAME} (lopt/_registry/{NAME} (ships with lopt)) True"
    assert not (tmp_path / "hf" / "hub").exists() or not any((tmp_path / "hf" / "hub").iterdir())


def test_the_cli_lists_it_as_shipped_and_download_says_so(capsys, offline_hub):
    assert cli_main(["weights", "list"]) == 0
    rows = {line.split("\t")[0]: line.split("\t") for line in capsys.readouterr().out.strip().splitlines()[1:]}
    assert rows[NAME][1:4] == ["small_fc_lopt", f"lopt/_registry/{NAME} (ships with lopt)", "shipped"]
    assert rows["small_fc_lopt"][2:4] == ["btherien/mulo@main", "not cached"]
    assert cli_main(["weights", "download", NAME]) == 0
    assert capsys.readouterr().out.startswith(f"{NAME} ships with lopt: nothing to download (files checked: ")


def test_a_damaged_installation_is_named(tmp_path):
    directory = tmp_path / "damaged"
    source = REPO_ROOT / "weights" / NAME
    directory.mkdir()
    (directory / "config.json").write_bytes((source / "config.json").read_bytes())
    entry = W.registered_weights()[NAME]
    files = dict(entry.components["mlp"].files)
    # an absolute path replaces the registry's directory
    W.register_weights(W.RegisteredWeights("lopt-test-damaged", "small_fc_lopt", "",
                                           {"mlp": W.PublishedComponent(None, "main", files, str(directory))}))
    try:
        assert W.cached_status("lopt-test-damaged") == "shipped, files missing"
        with pytest.raises(W.WeightsError, match=r"model\.safetensors is missing: 'lopt-test-damaged' ships with lopt, "
                                                 r"but this installation lacks its files; reinstall lopt"):
            W.load_weights("lopt-test-damaged", "small_fc_lopt")
        data = bytearray((source / "model.safetensors").read_bytes())
        data[-1] ^= 1
        (directory / "model.safetensors").write_bytes(bytes(data))
        with pytest.raises(W.WeightsError, match=r"is not the file registered for 'lopt-test-damaged' .*; reinstall lopt"):
            W.load_weights("lopt-test-damaged", "small_fc_lopt")
    finally:
        W.unregister_weights("lopt-test-damaged")


def test_the_offline_fixes_name_the_shipped_weights(offline_hub):
    with pytest.raises(W.WeightsError, match=rf"\n  - or weights='{NAME}': lopt's own meta-trained weights, shipped with "
                                             r"it, train offline\n"):
        W.load_weights("small_fc_lopt", "small_fc_lopt")


def _train(make_optimizer, seed=0, steps=100):
    """An MLP 40-64-64-10 on mnist1d (lopt's offline generator), batch 64: (first loss, mean of the last 10)."""
    from lopt.meta.data import mnist1d

    data = mnist1d(n_train=2000, n_test=10, seed=7)
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(40, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 10))
    optimizer = make_optimizer(model.parameters())
    batches = torch.randint(len(data.train_y), (steps, 64), generator=generator)
    losses = []
    for rows in batches:
        loss = torch.nn.functional.cross_entropy(model(data.train_x[rows]), data.train_y[rows])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses[0], sum(losses[-10:]) / 10


def test_it_trains_far_better_than_untrained_weights_and_adamw_default(single_intra_op_thread):
    first, shipped = _train(lambda p: lopt.SmallFCLOpt(p, weights=NAME, backend="naive"))
    _, untrained = _train(lambda p: lopt.SmallFCLOpt(p, weights=lopt.random_weights("small_fc_lopt"), backend="naive"))
    _, adamw = _train(lambda p: torch.optim.AdamW(p, lr=1e-3))
    # measured (seeds 0-2): shipped 1.25-1.29 from 2.31-2.33, untrained 2.30-2.31, AdamW 1e-3 2.00-2.02
    assert shipped < 0.7 * first, (first, shipped)
    assert shipped < untrained - 0.6, (shipped, untrained)
    assert shipped < adamw - 0.4, (shipped, adamw)
