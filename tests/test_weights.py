"""lopt.weights: every way to load small_fc_lopt meta-weights and every way loading can fail.

No machine here reaches the Hugging Face hub, so hub loading runs the real ``hf_hub_download`` code
offline against a private cache in hub layout (the ``offline_hub`` fixture of conftest.py) that
each test fills with files it built itself.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save, save_file

import lopt
from hub_cache import hub_layout_files
from lopt import weights as W
from lopt.weights import MetaWeights, PublishedComponent, RegisteredWeights, WeightsError, load_weights

ARCH = "small_fc_lopt"
REPO_ROOT = Path(__file__).resolve().parent.parent
# docs/small_fc_lopt.md §4: config.json and the tensors of PyLO's MetaMLP(39, 32, 1)
CONFIG = {"input_size": 39, "hidden_size": 32, "hidden_layers": 1}
SHAPES = {
    "network.input.weight": (32, 39),
    "network.input.bias": (32,),
    "network.linear_0.weight": (32, 32),
    "network.linear_0.bias": (32,),
    "network.output.weight": (2, 32),
    "network.output.bias": (2,),
}
PUBLISHED_SHA256 = "ad7c499d1bd389c768f20019a6e1a423c51c7d1db64774d038f4fe56bf21ccb3"
PUBLISHED_SIZE = 10096


def mlp_tensors(seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen) * 0.2 for name, shape in SHAPES.items()}


def config_bytes(config=None) -> bytes:
    return json.dumps(CONFIG if config is None else config).encode()


def write_dir(path: Path, tensors=None, config=None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_bytes(config_bytes(config))
    save_file(mlp_tensors() if tensors is None else tensors, str(path / "model.safetensors"))
    return path


def assert_same_tensors(loaded: MetaWeights, tensors: dict) -> None:
    got = loaded.tensors["mlp"]
    assert set(got) == set(tensors)
    for name, t in tensors.items():
        assert got[name].dtype == torch.float32
        assert torch.equal(got[name], t.to(torch.float32)), name


@pytest.fixture
def test_entry():
    """Registers a weight set (filled in by the test) and always unregisters it."""
    names = []

    def register(name, repo_id, files, revision="main"):
        entry = RegisteredWeights(name, ARCH, "test weights", {"mlp": PublishedComponent(repo_id, revision, files)})
        W.register_weights(entry)
        names.append(name)
        return entry

    yield register
    for name in names:
        W.unregister_weights(name)
    assert not any(name in W.registered_weights() for name in names)


def file_info(data: bytes) -> dict:
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


# ----------------------------------------------------------------------------------------- registry


def test_registry_describes_small_fc_lopt_and_its_published_weights():
    spec = W.architecture(ARCH)
    assert set(spec.components) == {"mlp"}
    assert spec.components["mlp"].tensors == SHAPES
    assert spec.components["mlp"].config == CONFIG
    entry = W.registered_weights()["small_fc_lopt"]
    assert entry.architecture == ARCH
    published = entry.components["mlp"]
    assert (published.repo_id, published.revision) == ("btherien/mulo", "main")
    assert published.files["model.safetensors"] == {"size": PUBLISHED_SIZE, "sha256": PUBLISHED_SHA256}
    assert "config.json" in published.files
    with pytest.raises(WeightsError, match=r"unknown learned-optimizer architecture 'adam_mlp'; known: \[.*'small_fc_lopt'"):
        W.architecture("adam_mlp")


def test_register_weights_errors(test_entry):
    test_entry("lopt-test-dup", "lopt-tests/dup", {"model.safetensors": None})
    again = RegisteredWeights("lopt-test-dup", ARCH, "", {"mlp": PublishedComponent("lopt-tests/other", "main", {})})
    with pytest.raises(WeightsError, match=r"weights 'lopt-test-dup' are already registered; pass overwrite=True"):
        W.register_weights(again)
    W.register_weights(again, overwrite=True)
    assert W.registered_weights()["lopt-test-dup"].components["mlp"].repo_id == "lopt-tests/other"
    with pytest.raises(WeightsError, match=r"unknown learned-optimizer architecture 'nope'"):
        W.register_weights(RegisteredWeights("lopt-test-x", "nope", "", {}))
    with pytest.raises(WeightsError, match=r"registered weights 'lopt-test-y' lack components \['mlp'\]"):
        W.register_weights(RegisteredWeights("lopt-test-y", ARCH, "", {}))
    assert "lopt-test-x" not in W.registered_weights() and "lopt-test-y" not in W.registered_weights()


# ----------------------------------------------------------------------------------------- hub, through the offline cache


def test_registered_name_through_the_offline_cache(offline_hub, test_entry):
    tensors = mlp_tensors(1)
    model = save(tensors)
    files = {"config.json": config_bytes(), "model.safetensors": model}
    test_entry("lopt-test-sfc", "lopt-tests/sfc-weights", {"config.json": None, "model.safetensors": file_info(model)})
    assert W.cached_status("lopt-test-sfc") == "not cached"
    offline_hub.add("lopt-tests/sfc-weights", {"config.json": files["config.json"]})
    assert W.cached_status("lopt-test-sfc") == "partly cached"
    with pytest.raises(WeightsError, match=r"cannot get model.safetensors of 'lopt-test-sfc' .*lopt-tests/sfc-weights@main"):
        load_weights("lopt-test-sfc", ARCH)
    snapshot = offline_hub.add("lopt-tests/sfc-weights", files)
    assert W.cached_status("lopt-test-sfc") == "cached"

    loaded = load_weights("lopt-test-sfc", ARCH)
    assert_same_tensors(loaded, tensors)
    assert loaded.configs == {"mlp": CONFIG} and loaded.pretrained
    assert loaded.source == "lopt-test-sfc (lopt-tests/sfc-weights@main)"
    assert W.download("lopt-test-sfc") == [snapshot]

    opt = lopt.SmallFCLOpt([torch.zeros(3, requires_grad=True)], weights="lopt-test-sfc", backend="naive")
    assert_same_tensors(opt.meta_weights, tensors)


def test_registered_name_with_wrong_checksum_or_size(offline_hub, test_entry):
    model = save(mlp_tensors(2))
    offline_hub.add("lopt-tests/sfc-bad", {"config.json": config_bytes(), "model.safetensors": model})
    other = hashlib.sha256(b"something else").hexdigest()
    test_entry("lopt-test-sha", "lopt-tests/sfc-bad", {"model.safetensors": {"size": len(model), "sha256": other}})
    with pytest.raises(WeightsError, match=(
            rf"checksum mismatch for .*model\.safetensors:\nsha256 {hashlib.sha256(model).hexdigest()}, expected {other} "
            rf"for lopt-tests/sfc-bad/model\.safetensors;\n.*delete it and download again "
            rf"\(`lopt weights download lopt-test-sha --force`\)")):
        load_weights("lopt-test-sha", ARCH)
    test_entry("lopt-test-size", "lopt-tests/sfc-bad", {"model.safetensors": {"size": 1234, "sha256": other}})
    with pytest.raises(WeightsError, match=rf"has {len(model)} bytes, but lopt-tests/sfc-bad/model\.safetensors has 1234:\n"
                                           r"the cached file is truncated or not the published one"):
        load_weights("lopt-test-size", ARCH)
    # verify_checksum=False loads the file anyway (names and shapes are still checked)
    assert_same_tensors(load_weights("lopt-test-sha", ARCH, verify_checksum=False), mlp_tensors(2))


def test_published_entry_with_an_unpublished_file_in_the_cache(offline_hub):
    same_size = save(mlp_tensors(3))  # no metadata: exactly the published file's 10,096 bytes, other content
    assert len(same_size) == PUBLISHED_SIZE
    offline_hub.add("btherien/mulo", {"config.json": config_bytes(), "model.safetensors": same_size})
    assert W.cached_status("small_fc_lopt") == "cached"
    with pytest.raises(WeightsError, match=rf"checksum mismatch (.|\n)*expected {PUBLISHED_SHA256} for btherien/mulo/model\.safetensors"):
        load_weights("small_fc_lopt", ARCH)
    with pytest.raises(WeightsError, match=r"checksum mismatch"):
        lopt.SmallFCLOpt([torch.zeros(2, requires_grad=True)])  # the default weights, at construction
    other_size = save(mlp_tensors(3), metadata={"format": "pt", "note": "not the published file"})
    offline_hub.add("btherien/mulo", {"config.json": config_bytes(), "model.safetensors": other_size})
    with pytest.raises(WeightsError, match=rf"has {len(other_size)} bytes, but btherien/mulo/model\.safetensors has 10096"):
        load_weights("small_fc_lopt", ARCH)


def test_hub_repo_id_and_revision_through_the_offline_cache(offline_hub):
    main, v2 = mlp_tensors(4), mlp_tensors(5)
    offline_hub.add("someone/sfc", {"config.json": config_bytes(), "model.safetensors": save(main)})
    offline_hub.add("someone/sfc", {"config.json": config_bytes(), "model.safetensors": save(v2)}, revision="v2")
    loaded = load_weights("someone/sfc", ARCH)
    assert_same_tensors(loaded, main)
    assert loaded.configs == {"mlp": CONFIG}
    assert_same_tensors(load_weights("someone/sfc@v2", ARCH), v2)
    assert load_weights("someone/sfc@v2", ARCH).source == "someone/sfc@v2"
    with pytest.raises(WeightsError, match=r"cannot get config\.json of 'someone/sfc@v3' from the Hugging Face hub repo someone/sfc@v3"):
        load_weights("someone/sfc@v3", ARCH)


def test_not_cached_and_offline_names_the_repo_and_the_fix(offline_hub):
    assert W.cached_status("small_fc_lopt") == "not cached"
    fix = (r"HF_HUB_OFFLINE is set and the file is not in the cache \(.*\)\.\nFix:\n"
           r"  - run `lopt weights download small_fc_lopt` on a machine with internet and copy its HF cache \(HF_HOME\) here\n"
           r"  - or pass weights=<a local directory with config\.json \+ model\.safetensors, or a \.safetensors file>\n"
           r"  - or weights='lopt-small_fc-tiny': lopt's own meta-trained weights, shipped with it, train offline\n"
           r"  - for timing only: weights=lopt\.random_weights\('small_fc_lopt'\) \(untrained: it does not train\)$")
    with pytest.raises(WeightsError, match=r"cannot get .* of 'small_fc_lopt' from the Hugging Face hub repo btherien/mulo@main: " + fix):
        load_weights("small_fc_lopt", ARCH)
    with pytest.raises(WeightsError, match=r"btherien/mulo@main: HF_HUB_OFFLINE is set"):
        lopt.SmallFCLOpt([torch.zeros(2, requires_grad=True)])
    with pytest.raises(WeightsError, match=r"from the Hugging Face hub repo nobody/missing@v1: HF_HUB_OFFLINE is set"):
        load_weights("nobody/missing@v1", ARCH)
    with pytest.raises(WeightsError, match=r"no registered weights named 'nope' \(known: \[.*'small_fc_lopt'.*\]\), and it is "
                                           r"not a hub repo id owner/name\[@revision\] either \(a repo id has exactly one '/'"):
        W.download("nope")


def test_hf_home_and_offline_are_read_from_the_environment(offline_hub, tmp_path):
    """A fresh process finds the cache through HF_HOME alone (huggingface_hub's constants are not patched there)."""
    tensors = mlp_tensors(6)
    offline_hub.add("someone/env-sfc", {"config.json": config_bytes(), "model.safetensors": save(tensors)})
    reference = tmp_path / "reference.safetensors"
    save_file(tensors, str(reference))
    code = (
        "import torch, lopt\n"
        "from safetensors.torch import load_file\n"
        "w = lopt.load_weights('someone/env-sfc', 'small_fc_lopt')\n"
        f"ref = load_file({str(reference)!r})\n"
        "assert all(torch.equal(w.tensors['mlp'][k], v) for k, v in ref.items())\n"
        "try:\n"
        "    lopt.load_weights('small_fc_lopt', 'small_fc_lopt')\n"
        "except lopt.WeightsError as err:\n"
        "    print('ERR', err)\n"
        "print('OK', w.source)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE"))}
    env.update(offline_hub.env(), PYTHONPATH=str(REPO_ROOT))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "OK someone/env-sfc" in result.stdout
    assert "HF_HUB_OFFLINE is set" in result.stdout and str(offline_hub.cache) in result.stdout


# ----------------------------------------------------------------------------------------- local files


def test_local_directory(tmp_path):
    tensors = mlp_tensors(7)
    directory = write_dir(tmp_path / "pylo_layout", tensors, config=dict(CONFIG, extra_key="kept"))
    for source in (directory, str(directory)):
        loaded = load_weights(source, ARCH)
        assert_same_tensors(loaded, tensors)
        assert loaded.configs == {"mlp": dict(CONFIG, extra_key="kept")}
        assert loaded.source == str(directory) and loaded.pretrained
    opt = lopt.SmallFCLOpt([torch.zeros(2, requires_grad=True)], weights=directory)
    assert_same_tensors(opt.meta_weights, tensors)


def test_local_directory_without_config_uses_the_architecture_config(tmp_path):
    directory = tmp_path / "no_config"
    directory.mkdir()
    save_file(mlp_tensors(8), str(directory / "model.safetensors"))
    loaded = load_weights(directory, ARCH)
    assert_same_tensors(loaded, mlp_tensors(8))
    assert loaded.configs == {"mlp": CONFIG}


def test_local_safetensors_file(tmp_path):
    tensors = mlp_tensors(9)
    path = tmp_path / "my_optimizer.safetensors"
    save_file(tensors, str(path))
    loaded = load_weights(str(path), ARCH)
    assert_same_tensors(loaded, tensors)
    assert loaded.configs == {"mlp": CONFIG} and loaded.source == str(path)
    other_suffix = tmp_path / "weights.bin"  # an existing file is read as safetensors whatever its name
    other_suffix.write_bytes(path.read_bytes())
    assert_same_tensors(load_weights(other_suffix, ARCH), tensors)


def test_other_float_dtypes_are_converted_to_float32(tmp_path):
    tensors = mlp_tensors(10)
    stored = {k: v.to(dtype) for (k, v), dtype in zip(tensors.items(), [torch.float16, torch.bfloat16, torch.float64] * 2)}
    path = tmp_path / "mixed.safetensors"
    save_file(stored, str(path))
    assert_same_tensors(load_weights(path, ARCH), {k: v.to(torch.float32) for k, v in stored.items()})


def test_meta_weights_instance():
    tensors = mlp_tensors(11)
    given = MetaWeights(ARCH, {"mlp": dict(tensors)}, {"mlp": dict(CONFIG)}, source="in memory")
    loaded = load_weights(given, ARCH)
    assert_same_tensors(loaded, tensors)
    assert loaded.source == "in memory" and loaded.configs == {"mlp": CONFIG}
    assert all(loaded.tensors["mlp"][k] is not tensors[k] for k in tensors)  # a validated copy
    opt = lopt.SmallFCLOpt([torch.zeros(2, requires_grad=True)], weights=given)
    assert_same_tensors(opt.meta_weights, tensors)
    with pytest.raises(WeightsError, match=r"these meta-weights are for 'velo_like', not 'small_fc_lopt'"):
        load_weights(MetaWeights("velo_like", {"mlp": dict(tensors)}, {"mlp": CONFIG}, "x"), ARCH)
    broken = dict(tensors)
    broken["network.input.bias"] = torch.full((32,), float("nan"))
    with pytest.raises(WeightsError, match=r"in memory: tensor network\.input\.bias has 32 non-finite values"):
        load_weights(MetaWeights(ARCH, {"mlp": broken}, {"mlp": CONFIG}, "in memory"), ARCH)


def test_save_load_round_trip_is_exact(tmp_path, offline_hub):
    original = lopt.random_weights(ARCH, seed=3)
    written = original.save(tmp_path / "saved")
    assert written == [tmp_path / "saved"]
    assert sorted(p.name for p in (tmp_path / "saved").iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((tmp_path / "saved" / "config.json").read_text()) == CONFIG
    raw = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in raw.items()} == SHAPES and all(v.dtype == torch.float32 for v in raw.values())
    loaded = load_weights(tmp_path / "saved", ARCH)
    assert_same_tensors(loaded, original.tensors["mlp"])
    assert loaded.configs == original.configs == {"mlp": CONFIG}
    # saving what was loaded gives the same bytes; and the written layout loads from a hub cache too
    loaded.save(tmp_path / "again")
    assert hub_layout_files(tmp_path / "again") == hub_layout_files(tmp_path / "saved")
    offline_hub.add("me/my-sfc", hub_layout_files(tmp_path / "saved"))
    assert_same_tensors(load_weights("me/my-sfc", ARCH), original.tensors["mlp"])


def test_random_weights_are_deterministic_per_seed():
    a, b, c = lopt.random_weights(ARCH, seed=5), lopt.random_weights(ARCH, seed=5), lopt.random_weights(ARCH, seed=6)
    assert not a.pretrained and a.source == "random (seed 5)" and a.configs == {"mlp": CONFIG}
    assert {k: tuple(v.shape) for k, v in a.tensors["mlp"].items()} == SHAPES
    for name, tensor in a.tensors["mlp"].items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, b.tensors["mlp"][name])
        assert not torch.equal(tensor, c.tensors["mlp"][name])
        fan_in = SHAPES[name][-1]
        assert tensor.abs().max().item() <= fan_in ** -0.5  # U(-1/sqrt(fan_in), 1/sqrt(fan_in)), as nn.Linear
        if tensor.numel() >= 32:
            assert tensor.std().item() > 0.4 * fan_in ** -0.5  # uniform: std = bound/sqrt(3) ≈ 0.58·bound
    assert_same_tensors(load_weights(a, ARCH), a.tensors["mlp"])
    with pytest.raises(WeightsError, match=r"unknown learned-optimizer architecture 'nope'"):
        lopt.random_weights("nope")


@pytest.mark.parametrize("name", ["elo_celo2", "elo", "celo2"])
def test_the_untrained_warning_names_the_weights_the_optimizer_defaults_to(name):
    """ELO-CELO2 shares CELO2's architecture but defaults to its own published weights: the warning's advice
    ("leave weights= out") names the set the constructor loads then, not the architecture."""
    import warnings

    entry = lopt.registry.get(name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        entry.front_end_class([torch.nn.Parameter(torch.randn(3, 2))], weights=lopt.random_weights(entry.architecture, seed=2))
    messages = [str(w.message) for w in caught if issubclass(w.category, lopt.UntrainedWeightsWarning)]
    assert len(messages) == 1 and entry.default_weights in {"elo-celo2", "elo", "celo2"}
    assert f"Leave weights= out for the published {entry.default_weights} weights;" in messages[0]


def test_optimizers_warn_once_at_construction_that_random_weights_are_untrained(tmp_path):
    import copy
    import warnings

    from lopt.bench import contenders

    assert issubclass(lopt.UntrainedWeightsWarning, UserWarning) and "UntrainedWeightsWarning" in lopt.__all__
    params = [torch.nn.Parameter(torch.ones(3, 2))]
    for make, name in ((lambda w: lopt.SmallFCLOpt(params, weights=w), ARCH),
                       (lambda w: lopt.VeLO(params, num_steps=10, weights=w), "velo")):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt = make(lopt.random_weights(name, seed=3))
            opt.zero_grad()
            params[0].grad = torch.ones(3, 2)
            opt.step(torch.tensor(1.0)) if name == "velo" else opt.step()
            copy.deepcopy(opt)
        untrained = [w for w in caught if issubclass(w.category, lopt.UntrainedWeightsWarning)]
        assert len(untrained) == 1, [str(w.message) for w in caught]
        assert untrained[0].filename == __file__  # points at the line that built the optimizer
        offline = " (or pass weights='lopt-small_fc-tiny', shipped with lopt: it trains offline)" if name == ARCH else ""
        assert str(untrained[0].message) == (
            f"{type(opt).__name__}: the meta-weights are untrained (random (seed 3)): its steps can be timed, but it "
            f"does not train a model. Leave weights= out for the published {name} weights{offline}; where untrained "
            f"weights are intended, silence this with warnings.filterwarnings('ignore', category=lopt.UntrainedWeightsWarning)")
        # weights from a file are taken as trained (nothing says otherwise): no warning
        directory = lopt.random_weights(name, seed=3).save(
            tmp_path / name if name == ARCH else {"rnn": tmp_path / "rnn", "mlp": tmp_path / "mlp"})
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            make(directory[0] if name == ARCH else tuple(directory))
    # lopt bench times untrained weights on purpose and says so in its header: its optimizers do not warn
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        contenders.make_contender(ARCH, "naive", params, lopt.random_weights(ARCH), torch.device("cpu"))
        contenders.make_contender("velo", "naive", params, lopt.random_weights("velo"), torch.device("cpu"))


# ----------------------------------------------------------------------------------------- malformed files


def _without(name):
    t = mlp_tensors(12)
    del t[name]
    return t


@pytest.mark.parametrize("tensors,pattern", [
    (_without("network.output.bias"),
     r"does not hold the mlp network lopt expects: missing \['network\.output\.bias'\] \(expected exactly "
     r"\['network\.input\.weight', .*\]\); are these weights for another optimizer\?"),
    (dict(mlp_tensors(12), **{"extra.scale": torch.ones(3)}), r"lopt expects: unexpected \['extra\.scale'\] \(expected exactly"),
    (dict(_without("network.input.weight"), **{"network.input.kernel": torch.ones(32, 39)}),
     r"missing \['network\.input\.weight'\]; unexpected \['network\.input\.kernel'\]"),
    ({k.removeprefix("network."): v for k, v in mlp_tensors(12).items()},
     r"missing \['network\.input\.weight', .*'network\.output\.bias'\]; unexpected \[.*'input\.weight'.*\]"),
], ids=["missing", "unexpected", "renamed", "no_prefix"])
def test_wrong_tensor_names(tmp_path, tensors, pattern):
    path = tmp_path / "w.safetensors"
    save_file(tensors, str(path))
    with pytest.raises(WeightsError, match=rf"{path}.*" + pattern):
        load_weights(path, ARCH)


@pytest.mark.parametrize("name,shape", [("network.input.weight", (39, 32)), ("network.output.bias", (3,)),
                                        ("network.linear_0.weight", (32, 32, 1))])
def test_wrong_shapes_say_expected_and_got(tmp_path, name, shape):
    tensors = mlp_tensors(13)
    tensors[name] = torch.randn(shape)
    directory = write_dir(tmp_path / "d", tensors)
    expected = SHAPES[name]
    with pytest.raises(WeightsError, match=rf"model\.safetensors: tensor {name} has shape \({', '.join(map(str, shape))},?\), "
                                           rf"expected \({', '.join(map(str, expected))},?\)"):
        load_weights(directory, ARCH)
    with pytest.raises(WeightsError, match=r"has shape"):
        lopt.SmallFCLOpt([torch.zeros(2, requires_grad=True)], weights=directory)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values(tmp_path, value):
    tensors = mlp_tensors(14)
    tensors["network.linear_0.weight"][3, 7] = value
    path = tmp_path / "w.safetensors"
    save_file(tensors, str(path))
    with pytest.raises(WeightsError, match=r"tensor network\.linear_0\.weight has 1 non-finite values \(NaN or inf\); the file is corrupt"):
        load_weights(path, ARCH)


def test_integer_tensor_is_rejected(tmp_path):
    tensors = mlp_tensors(15)
    tensors["network.output.bias"] = torch.tensor([1, 2], dtype=torch.int32)
    path = tmp_path / "w.safetensors"
    save_file(tensors, str(path))
    with pytest.raises(WeightsError, match=r"tensor network\.output\.bias has dtype torch\.int32, expected a floating-point dtype"):
        load_weights(path, ARCH)


def _corrupt(kind: str, good: bytes) -> bytes:
    if kind == "truncated":
        return good[: len(good) // 2]
    if kind == "header_only":
        return good[:600]
    if kind == "empty":
        return b""
    if kind == "bad_header_length":
        return (10**9).to_bytes(8, "little") + good[8:]
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["truncated", "header_only", "empty", "bad_header_length"])
def test_corrupt_or_truncated_file(tmp_path, kind):
    good = save(mlp_tensors(16))
    directory = tmp_path / "d"
    directory.mkdir()
    (directory / "config.json").write_bytes(config_bytes())
    (directory / "model.safetensors").write_bytes(_corrupt(kind, good))
    with pytest.raises(WeightsError, match=r"model\.safetensors is not a readable safetensors file \(.*\); it is probably "
                                           r"truncated or corrupt: delete it and download or save it again"):
        load_weights(directory, ARCH)


@pytest.mark.parametrize("config,pattern", [
    # (hidden_size and hidden_layers are the weights' own choice: the tensors must then have that geometry)
    (dict(CONFIG, hidden_size=64), r"tensor network\.input\.weight has shape \(32, 39\), expected \(64, 39\)"),
    (dict(CONFIG, input_size=40, hidden_layers=2), r"input_size=40 \(lopt needs 39\)"),
    ([39, 32, 1], r"config\.json must hold a JSON object, got list"),
], ids=["hidden_size", "two_fields", "not_an_object"])
def test_wrong_config_json(tmp_path, config, pattern):
    directory = write_dir(tmp_path / "d", config=config)
    with pytest.raises(WeightsError, match=pattern):
        load_weights(directory, ARCH)


def test_config_json_that_is_not_json(tmp_path):
    directory = write_dir(tmp_path / "d")
    (directory / "config.json").write_text("{input_size: 39,")
    with pytest.raises(WeightsError, match=r"config\.json is not valid JSON \(.*\); replace it with the config\.json of the published weights"):
        load_weights(directory, ARCH)


def run_suggested_conversion(message: str) -> None:
    """Run the shell command a WeightsError suggests (``python3 -c "..."``), exactly as printed."""
    command = re.search(r'python3 -c "[^"]*"', message).group(0)
    result = subprocess.run(["bash", "-c", command.replace("python3", shlex.quote(sys.executable), 1)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_directory_without_model_safetensors(tmp_path):
    directory = tmp_path / "only_config"
    directory.mkdir()
    (directory / "config.json").write_bytes(config_bytes())
    with pytest.raises(WeightsError, match=rf"{directory} has no model\.safetensors; expected PyLO's hub layout: "
                                           r"config\.json \+ model\.safetensors"):
        load_weights(directory, ARCH)
    tensors = mlp_tensors(17)
    torch.save(tensors, directory / "pytorch_model.bin")
    with pytest.raises(WeightsError, match=r"has no model\.safetensors \(it has pytorch_model\.bin: convert it with python3 -c "
                                           r"\"import torch, safetensors\.torch as st; st\.save_file\(torch\.load\(open\(.*pytorch_model\.bin', 'rb'\)\), "
                                           r".*model\.safetensors'\)\"\)") as raised:
        load_weights(directory, ARCH)
    run_suggested_conversion(str(raised.value))  # the fix the message names works
    assert_same_tensors(load_weights(directory, ARCH), tensors)


def test_paths_that_are_directories_where_files_belong(tmp_path):
    """model.safetensors (or config.json) that is a directory, and a directory named like a .safetensors file."""
    layout = tmp_path / "layout"
    (layout / "model.safetensors").mkdir(parents=True)
    (layout / "config.json").write_bytes(config_bytes())
    with pytest.raises(WeightsError, match=rf"^{re.escape(str(layout / 'model.safetensors'))} is a directory, not a "
                                           r"safetensors file\.\nPyLO's hub layout is a directory holding the files "
                                           r"config\.json and model\.safetensors$"):
        load_weights(layout, ARCH)
    write_dir(layout / "model.safetensors", mlp_tensors(22))  # the real layout one level down (a copy gone wrong)
    with pytest.raises(WeightsError, match=rf"is a directory, not a safetensors file; it holds a model\.safetensors itself: "
                                           rf"pass {re.escape(str(layout / 'model.safetensors'))} instead"):
        load_weights(layout, ARCH)
    assert_same_tensors(load_weights(layout / "model.safetensors", ARCH), mlp_tensors(22))  # ... which works

    named = tmp_path / "weights.safetensors"
    named.mkdir()
    with pytest.raises(WeightsError, match=rf"^{re.escape(str(named))} is a directory, not a \.safetensors file; pass the "
                                           r"file itself, or a directory holding config\.json \+ model\.safetensors$"):
        load_weights(named, ARCH)

    config_dir = write_dir(tmp_path / "config_dir")
    (config_dir / "config.json").unlink()
    (config_dir / "config.json").mkdir()
    with pytest.raises(WeightsError, match=r"config\.json is a directory, not a JSON file; remove it or replace it"):
        load_weights(config_dir, ARCH)


def test_weights_none_or_another_type_says_what_to_pass():
    with pytest.raises(WeightsError, match=r"^weights=None: small_fc_lopt needs meta-weights\. Leave weights out for the "
                                           r"published ones \('small_fc_lopt'\), or pass\n  a registered name \(\['lopt-small_fc-tiny', 'small_fc_lopt'\]\), "
                                           r"a hub repo id owner/name\[@revision\], a local directory with config\.json \+ "
                                           r"model\.safetensors,\n  a \.safetensors file, or lopt\.random_weights\('small_fc_lopt'\) "
                                           r"\(untrained, for timing only\)$"):
        lopt.SmallFCLOpt([torch.zeros(2, requires_grad=True)], weights=None)
    with pytest.raises(WeightsError, match=r"^weights=None: velo needs meta-weights\. .*\('velo'\)"):
        lopt.VeLO([torch.zeros(2, requires_grad=True)], num_steps=10, weights=None)
    with pytest.raises(WeightsError, match=r"^weights for the mlp network must be a path or a hub repo id, got int 3$"):
        load_weights(3, ARCH)
    with pytest.raises(WeightsError, match=r"^weights for the rnn network must be a path or a hub repo id, got NoneType None$"):
        load_weights((None, "somewhere"), "velo")


def _torch_save_zip(tensors, path):
    torch.save(tensors, path)


def _torch_save_legacy_pickle(tensors, path):
    torch.save(tensors, path, _use_new_zipfile_serialization=False)


@pytest.mark.parametrize("writer,what", [
    (_torch_save_zip, r"it is a zip archive, the format torch\.save writes \(a PyTorch checkpoint\)"),
    (_torch_save_legacy_pickle, r"it is a Python pickle \(a PyTorch checkpoint written by an older torch\.save\)"),
], ids=["zip", "pickle"])
def test_pytorch_checkpoint_named_safetensors(tmp_path, writer, what):
    """A torch.save file renamed .safetensors is named as such (not 'truncated'), and the conversion it suggests works."""
    tensors = mlp_tensors(19)
    directory = tmp_path / "d"
    directory.mkdir()
    (directory / "config.json").write_bytes(config_bytes())
    writer(tensors, directory / "model.safetensors")
    with pytest.raises(WeightsError, match=rf"model\.safetensors is not a safetensors file: {what}; convert it in place with "
                                           r"python3 -c ") as raised:
        load_weights(directory, ARCH)
    assert "truncated" not in str(raised.value)
    run_suggested_conversion(str(raised.value))
    assert_same_tensors(load_weights(directory, ARCH), tensors)


@pytest.mark.parametrize("content,what", [
    (b"version https://git-lfs.github.com/spec/v1\noid sha256:" + b"ab" * 32 + b"\nsize 10096\n",
     r"it is a Git LFS pointer, not the file's content; fetch the real file \(`git lfs pull` in the clone, or download "
     r"the repository through the Hugging Face hub\)"),
    (bytes(range(256)) * 8, r"its first 8 bytes give a header length of 506097522914230528 bytes \(the file has 2048\) "
                            r"and no JSON header follows; pass a file written by safetensors"),
    (b"not a safetensors file", rf"its first 8 bytes give a header length of {int.from_bytes(b'not a sa', 'little')} bytes "
                                r"\(the file has 22\) and no JSON header follows"),
], ids=["git_lfs_pointer", "binary_garbage", "text"])
def test_other_files_named_safetensors(tmp_path, content, what):
    path = tmp_path / "w.safetensors"
    path.write_bytes(content)
    with pytest.raises(WeightsError, match=rf"w\.safetensors is not a safetensors file: {what}"):
        load_weights(path, ARCH)


def test_nonexistent_local_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    missing_file = tmp_path / "nope.safetensors"
    with pytest.raises(WeightsError, match=rf"weights file {missing_file} does not exist$"):
        load_weights(missing_file, ARCH)
    with pytest.raises(WeightsError, match=rf"weights file nope\.safetensors does not exist \(looked for {missing_file}\)"):
        load_weights("nope.safetensors", ARCH)
    with pytest.raises(WeightsError, match=rf"no directory or file {tmp_path / 'missing_dir'} exists; pass a directory with "
                                           r"config\.json \+ model\.safetensors or a \.safetensors file"):
        lopt.SmallFCLOpt([torch.zeros(2, requires_grad=True)], weights=Path("missing_dir"))  # a Path is never a repo id


def _forbid_network(monkeypatch, *, hub_calls_too: bool = False) -> list:
    """Record and refuse every network connection (and, optionally, every huggingface_hub download call)."""
    import socket

    import huggingface_hub

    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise AssertionError(f"network access attempted: {args}")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    if hub_calls_too:
        monkeypatch.setattr(huggingface_hub, "hf_hub_download", refuse)
    return attempts


@pytest.mark.parametrize("source,problem", [
    ("not a/valid id!!", r"Repo id must use alphanumeric chars"),
    ("a/b/c", r"a repo id has exactly one '/', 'a/b/c' has 2"),
    ("not-a-repo-or-name", r"a repo id has exactly one '/', 'not-a-repo-or-name' has 0"),
    ("./definitely/not/here", r"a repo id has exactly one '/', '\./definitely/not/here' has 3"),
    ("~nobody/x", r"Repo id must use alphanumeric chars"),
])
def test_neither_a_local_path_nor_a_valid_repo_id(tmp_path, monkeypatch, source, problem):
    """Said at once, without asking the hub, and naming the absolute path that was looked for."""
    monkeypatch.chdir(tmp_path)
    attempts = _forbid_network(monkeypatch, hub_calls_too=True)
    absolute = Path(os.path.expanduser(source)).absolute()
    with pytest.raises(WeightsError, match=(
            rf"cannot find meta-weights {re.escape(repr(source))}: no local directory or file {re.escape(str(absolute))} "
            r"exists,\nit is not a registered name \(\[.*'small_fc_lopt'.*\]\),\nand it is not a valid hub repo id "
            rf"owner/name\[@revision\] \({problem}.*\)\.\nPass an existing directory with config\.json \+ model\.safetensors, "
            r"a \.safetensors file, a registered name or a hub repo id$")):
        load_weights(source, ARCH)
    assert attempts == []


def test_missing_relative_path_offline_names_the_path_and_the_cache_without_network(offline_hub, tmp_path, monkeypatch):
    """'ckpts/mulo' could be a local directory or a repo id: offline, the message says both, and nothing goes to the network."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ckpts").mkdir()  # the parent exists, the directory does not (a typo, or not copied yet)
    attempts = _forbid_network(monkeypatch)
    with pytest.raises(WeightsError, match=(
            rf"cannot find meta-weights 'ckpts/mulo': no local directory or file {re.escape(str(tmp_path / 'ckpts' / 'mulo'))} "
            r"exists,\nand as a hub repo id: cannot get config\.json of 'ckpts/mulo' from the Hugging Face hub repo "
            r"ckpts/mulo@main: HF_HUB_OFFLINE is set and the file is not in the cache")):
        load_weights("ckpts/mulo", ARCH)
    with pytest.raises(WeightsError, match=r"btherien/mulo@main: HF_HUB_OFFLINE is set"):
        load_weights("small_fc_lopt", ARCH)
    assert attempts == []
    # the directory it names is the one that is then found
    write_dir(tmp_path / "ckpts" / "mulo", mlp_tensors(20))
    assert_same_tensors(load_weights("ckpts/mulo", ARCH), mlp_tensors(20))


def test_unreachable_hub_message_for_a_missing_relative_path(tmp_path, monkeypatch, unreachable_hub):
    """Online but the hub refuses connections: both facts, at once (no retries), and what to do."""
    import time

    monkeypatch.chdir(tmp_path)
    started = time.monotonic()
    with pytest.raises(WeightsError, match=(
            rf"cannot find meta-weights 'ckpts/mulo@v2': no local directory or file {re.escape(str(tmp_path / 'ckpts' / 'mulo@v2'))} "
            r"exists,\nand as a hub repo id: cannot get config\.json of 'ckpts/mulo@v2' from the Hugging Face hub repo "
            rf"ckpts/mulo@v2: the hub at {re.escape(unreachable_hub)} is unreachable \(\w+: .*\) and the "
            r"file is not in the cache \(.*\)\.\nFix:\n  - run `lopt weights download ckpts/mulo@v2` on a machine with internet"
            r"(.|\n)*  - once the cache is filled, set HF_HUB_OFFLINE=1")):
        load_weights("ckpts/mulo@v2", ARCH)
    assert time.monotonic() - started < 5


def test_download_accepts_a_repo_id_as_the_messages_suggest(offline_hub, capsys):
    """The offline message says `lopt weights download <repo-id>`: that command exists and fills/validates the cache."""
    from lopt import cli

    with pytest.raises(WeightsError, match=r"run `lopt weights download someone/sfc@v2` on a machine with internet") as raised:
        load_weights("someone/sfc@v2", ARCH)
    assert cli.main(["weights", "download", "someone/sfc@v2"]) == 2
    assert "HF_HUB_OFFLINE is set and the file is not in the cache" in capsys.readouterr().err
    # what the download on the connected machine leaves in the (copied) cache
    snapshot = offline_hub.add("someone/sfc", {"config.json": config_bytes(), "model.safetensors": save(mlp_tensors(21))},
                               revision="v2")
    assert "someone/sfc@v2" in str(raised.value)
    assert W.download("someone/sfc@v2") == [snapshot]
    assert cli.main(["weights", "download", "someone/sfc@v2"]) == 0
    assert capsys.readouterr().out.strip() == str(snapshot)
    assert_same_tensors(load_weights("someone/sfc@v2", ARCH), mlp_tensors(21))
    # a VeLO network alone is a known network too
    velo = lopt.random_weights("velo", seed=1)
    velo_dirs = velo.save({"rnn": offline_hub.home / "rnn", "mlp": offline_hub.home / "mlp"})
    rnn_snapshot = offline_hub.add("someone/velo-rnn", hub_layout_files(velo_dirs[0]))
    assert W.download("someone/velo-rnn") == [rnn_snapshot]


def test_download_errors(offline_hub):
    offline_hub.add("someone/other-model", {"config.json": b'{"hidden_size": 768}', "model.safetensors": save({"w": torch.ones(3)})})
    with pytest.raises(WeightsError, match=r"someone/other-model \(cached in .*\) holds none of the networks lopt knows:\n"
                                           r"  - as small_fc_lopt: .*\n  - as the rnn network of velo: .*\n"
                                           r"  - as the mlp network of velo: "):
        W.download("someone/other-model")
    with pytest.raises(WeightsError, match=r"no registered weights named 'a/b/c' \(known: .*\), and it is not a hub repo id "
                                           r"owner/name\[@revision\] either \(a repo id has exactly one '/', 'a/b/c' has 2\)"):
        W.download("a/b/c")
    with pytest.raises(WeightsError, match=r"cannot download 'someone/other-model' again while HF_HUB_OFFLINE is set: unset it"):
        W.download("someone/other-model", force=True)
    with pytest.raises(WeightsError, match=r"cannot download 'small_fc_lopt' again while HF_HUB_OFFLINE is set"):
        W.download("small_fc_lopt", force=True)


# ----------------------------------------------------------------------------------------- verify


def test_verify(tmp_path):
    tensors = mlp_tensors(18)
    good = write_dir(tmp_path / "good", tensors)
    arch, loaded = W.verify(good)
    assert arch == ARCH
    assert_same_tensors(loaded, tensors)
    arch, loaded = W.verify(str(good), ARCH)
    assert arch == ARCH
    bad_tensors = dict(tensors)
    bad_tensors["network.output.weight"] = torch.randn(32, 2)
    bad = write_dir(tmp_path / "bad", bad_tensors)
    with pytest.raises(WeightsError, match=r"as small_fc_lopt: .*tensor network\.output\.weight has shape \(32, 2\), expected \(2, 32\)"):
        W.verify(bad)
    with pytest.raises(WeightsError, match=r"as small_fc_lopt: .*weights file .*absent\.safetensors does not exist"):
        W.verify(tmp_path / "absent.safetensors", ARCH)
    with pytest.raises(WeightsError, match=r"unknown learned-optimizer architecture 'other'"):
        W.verify(good, "other")


def test_verify_a_velo_pair(tmp_path):
    """VeLO's two networks are verified together, as a tuple (rnn, mlp) or a dict; one alone says what is missing."""
    velo = lopt.random_weights("velo", seed=2)
    rnn_dir, mlp_dir = velo.save((tmp_path / "rnn", tmp_path / "mlp"))
    for source in ((rnn_dir, mlp_dir), [str(rnn_dir), str(mlp_dir)], {"mlp": mlp_dir, "rnn": rnn_dir}):
        arch, loaded = W.verify(source)
        assert arch == "velo"
        for comp in ("rnn", "mlp"):
            assert all(torch.equal(loaded.tensors[comp][k], v) for k, v in velo.tensors[comp].items())
    assert W.verify((rnn_dir, mlp_dir), "velo")[0] == "velo"
    with pytest.raises(WeightsError, match=r"as velo: .*mlp/model\.safetensors does not hold the rnn network lopt expects"):
        W.verify((mlp_dir, rnn_dir))  # swapped
    with pytest.raises(WeightsError, match=rf"{rnn_dir} holds the rnn network of velo only; velo needs one source per network "
                                           r"\['rnn', 'mlp'\]: pass them together, verify\(\(rnn_dir, mlp_dir\)\)"):
        W.verify(rnn_dir)
    with pytest.raises(WeightsError, match=r"no architecture has the networks given \(3 sources\); the architectures' networks: "
                                           r"\{'small_fc_lopt': \['mlp'\], 'velo': \['rnn', 'mlp'\]"):  # (, and later ones)
        W.verify((rnn_dir, mlp_dir, mlp_dir))
    with pytest.raises(WeightsError, match=r"weights for small_fc_lopt needs 1 entries"):
        W.verify((rnn_dir, mlp_dir), ARCH)
