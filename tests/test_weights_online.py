"""lopt.weights' online path: huggingface_hub downloading from a hub over HTTP.

The hub is tests/hub_server.py on 127.0.0.1 (the ``online_hub`` fixture of conftest.py points
huggingface_hub's endpoint and cache at it and at a private HF_HOME), so every test runs the real
``hf_hub_download`` and lopt's code around it: first download, cache reuse, pinned revisions,
``--force``, missing repos/revisions/files, 5xx answers, a transfer cut off half-way, checksum
mismatches, and the fallback to the cache when offline or when the hub is down (the
``unreachable_hub`` fixture: a closed port, where connections are refused at once).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

import lopt
from lopt import cli
from lopt import weights as W
from lopt.weights import PublishedComponent, RegisteredWeights, WeightsError, load_weights

ARCH = "small_fc_lopt"
REPO_ROOT = Path(__file__).resolve().parent.parent
CONFIG = {"input_size": 39, "hidden_size": 32, "hidden_layers": 1}  # docs/small_fc_lopt.md §4
SHAPES = {"network.input.weight": (32, 39), "network.input.bias": (32,), "network.linear_0.weight": (32, 32),
          "network.linear_0.bias": (32,), "network.output.weight": (2, 32), "network.output.bias": (2,)}
FAST_S = 5.0  # what "at once" means here: no retries with backoff (huggingface_hub's take ~25 s and more)


def mlp_tensors(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen) * 0.2 for name, shape in SHAPES.items()}


def hub_files(seed: int) -> dict:
    return {"config.json": json.dumps(CONFIG).encode(), "model.safetensors": save(mlp_tensors(seed))}


def file_info(data: bytes) -> dict:
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def assert_same_tensors(loaded, seed: int) -> None:
    expected = mlp_tensors(seed)
    got = loaded.tensors["mlp"]
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def cache_files(hub, repo_id: str) -> dict:
    """{relative path: size} of everything in the cache under ``repo_id`` (symlinks as their target's size)."""
    root = hub.cache / ("models--" + repo_id.replace("/", "--"))
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}


@pytest.fixture
def registered():
    """register(name, repo_id, files) a small_fc_lopt weight set published in ``repo_id``; unregistered afterwards."""
    names = []

    def register(name, repo_id, files, revision="main", architecture=ARCH):
        comps = files if architecture != ARCH else {"mlp": PublishedComponent(repo_id, revision, files)}
        W.register_weights(RegisteredWeights(name, architecture, "test weights", comps))
        names.append(name)

    yield register
    for name in names:
        W.unregister_weights(name)


def run_cli(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


# ------------------------------------------------------------------------------------------ downloads


def test_first_download_then_the_cache_without_a_second_get(online_hub, registered):
    server = online_hub.server
    files = hub_files(1)
    server.add("lopt-tests/sfc", files)
    registered("lopt-online-sfc", "lopt-tests/sfc", {"config.json": None, "model.safetensors": file_info(files["model.safetensors"])})
    assert W.cached_status("lopt-online-sfc") == "not cached"

    loaded = load_weights("lopt-online-sfc", ARCH)
    assert_same_tensors(loaded, 1)
    assert loaded.source == "lopt-online-sfc (lopt-tests/sfc@main)" and loaded.pretrained
    assert W.cached_status("lopt-online-sfc") == "cached"
    # what went over the wire: the hub's resolve URLs (the large file redirected to the CDN), each file fetched once
    assert server.count("GET", "config.json", server="hub") == 1
    assert server.count("GET", "model.safetensors", server="cdn") == 1
    assert server.count("HEAD", "model.safetensors", server="hub") >= 1
    assert all(r.status in (200, 302) for r in server.requests if "/resolve/" in r.path or "/blobs/" in r.path)
    # the cache holds exactly the published bytes, in huggingface_hub's layout
    stored = cache_files(online_hub, "lopt-tests/sfc")
    assert stored[f"blobs/{hashlib.sha256(files['model.safetensors']).hexdigest()}"] == len(files["model.safetensors"])
    assert not any(name.endswith(".incomplete") for name in stored)

    # again, and through the optimizer: the hub is asked whether main moved (HEAD), nothing is downloaded again
    gets = server.count("GET")
    opt = lopt.SmallFCLOpt([torch.zeros(3, requires_grad=True)], weights="lopt-online-sfc", backend="naive")
    assert_same_tensors(opt.meta_weights, 1)
    assert server.count("GET") == gets


def test_repo_ids_and_pinned_revisions(online_hub):
    server = online_hub.server
    server.add("someone/sfc", hub_files(2))
    server.add("someone/sfc", hub_files(3), revision="v2")
    assert_same_tensors(load_weights("someone/sfc", ARCH), 2)
    assert_same_tensors(load_weights("someone/sfc@v2", ARCH), 3)
    assert load_weights("someone/sfc@v2", ARCH).source == "someone/sfc@v2"
    # main moves on: an unpinned load follows it, a load pinned to the old commit keeps the old weights
    old_commit = server.add("someone/sfc", hub_files(2), revision="old")  # (same files as main had)
    new_commit = server.add("someone/sfc", hub_files(4))
    assert old_commit != new_commit
    assert_same_tensors(load_weights("someone/sfc", ARCH), 4)
    before = len(server.requests)
    assert_same_tensors(load_weights(f"someone/sfc@{old_commit}", ARCH), 2)
    requested = server.requests[before:]
    assert all(f"/resolve/{old_commit}/" in r.path or "/blobs/" in r.path for r in requested)


def test_lopt_weights_download_and_force(online_hub, registered, capsys):
    server = online_hub.server
    server.add("someone/my-lopt", hub_files(5))
    code, out, err = run_cli(capsys, "weights", "download", "someone/my-lopt")
    assert code == 0, err
    (snapshot,) = out.split()
    assert Path(snapshot).parent.parent == online_hub.cache / "models--someone--my-lopt"
    assert sorted(os.listdir(snapshot)) == ["config.json", "model.safetensors"]
    gets = server.count("GET")
    assert gets == 2
    code, out, _ = run_cli(capsys, "weights", "download", "someone/my-lopt")
    assert code == 0 and out.split() == [snapshot] and server.count("GET") == gets  # cached: nothing fetched
    code, out, _ = run_cli(capsys, "weights", "download", "someone/my-lopt", "--force")
    assert code == 0 and out.split() == [snapshot] and server.count("GET") == gets + 2  # both files again

    # a registered VeLO set: its two repositories
    velo = lopt.random_weights("velo", seed=1)
    rnn_dir, mlp_dir = velo.save({"rnn": online_hub.home / "rnn", "mlp": online_hub.home / "mlp"})
    for repo, directory in (("someone/velo-rnn", rnn_dir), ("someone/velo-mlp", mlp_dir)):
        server.add(repo, {p.name: p.read_bytes() for p in directory.iterdir()})
    registered("lopt-online-velo", None, {
        "rnn": PublishedComponent("someone/velo-rnn", "main", {"config.json": None, "model.safetensors": None}),
        "mlp": PublishedComponent("someone/velo-mlp", "main", {"config.json": None, "model.safetensors": None})},
        architecture="velo")
    code, out, err = run_cli(capsys, "weights", "download", "lopt-online-velo")
    assert code == 0, err
    assert [Path(p).parent.parent.name for p in out.split()] == ["models--someone--velo-rnn", "models--someone--velo-mlp"]
    loaded = load_weights("lopt-online-velo", "velo")
    for comp in ("rnn", "mlp"):
        for name, tensor in velo.tensors[comp].items():
            assert torch.equal(loaded.tensors[comp][name], tensor)


def test_lopt_weights_download_in_a_fresh_process_finds_the_hub_through_hf_endpoint(online_hub):
    """The console command, with only the environment (HF_ENDPOINT, HF_HOME) pointing at the hub."""
    online_hub.server.add("someone/env-sfc", hub_files(6))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE"))}
    env.update(online_hub.env(), PYTHONPATH=str(REPO_ROOT))
    result = subprocess.run([sys.executable, "-m", "lopt.cli", "weights", "download", "someone/env-sfc"], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    snapshot = Path(result.stdout.split()[-1])
    assert snapshot.parent.parent == online_hub.cache / "models--someone--env-sfc"
    assert online_hub.server.count("GET", "model.safetensors", server="cdn") == 1
    assert_same_tensors(load_weights(str(snapshot), ARCH), 6)


# ------------------------------------------------------------------------------------------ what the hub answers


def test_missing_repo_revision_or_file_is_said_at_once(online_hub, registered):
    server = online_hub.server
    server.add("someone/config-only", {"config.json": json.dumps(CONFIG).encode()})
    started = time.monotonic()
    with pytest.raises(WeightsError, match=r"cannot find meta-weights 'nobody/none': no local directory or file .* exists,\n"
                                           r"and as a hub repo id: hub repository 'nobody/none' does not exist \(or is "
                                           r"private\); check the repo id$"):
        load_weights("nobody/none", ARCH)
    with pytest.raises(WeightsError, match=r"hub repository 'someone/config-only' has no revision 'v9'$"):
        load_weights("someone/config-only@v9", ARCH)
    with pytest.raises(WeightsError, match=r"hub repository someone/config-only@main has no file 'model\.safetensors'$"):
        load_weights("someone/config-only", ARCH)
    registered("lopt-online-missing", "nobody/none", {"config.json": None, "model.safetensors": None})
    with pytest.raises(WeightsError, match=r"^hub repository 'nobody/none' does not exist \(or is private\)"):
        lopt.SmallFCLOpt([torch.zeros(2, requires_grad=True)], weights="lopt-online-missing")
    assert time.monotonic() - started < FAST_S  # a 404 is not retried
    assert {r.status for r in server.requests if "/resolve/" in r.path} <= {200, 404}


def test_a_5xx_answer_is_retried_and_then_succeeds(online_hub):
    """The hub answers 503 three times: lopt's reachability check, huggingface_hub's first request and its first
    retry; huggingface_hub's next retry (after 1 s of backoff) gets the file."""
    server = online_hub.server
    server.add("someone/flaky", hub_files(7))
    server.fail(action="status", status=503, method="HEAD", filename="config.json", times=3)
    started = time.monotonic()
    assert_same_tensors(load_weights("someone/flaky", ARCH), 7)
    assert time.monotonic() - started < 10
    heads = [r.status for r in server.requests if r.method == "HEAD" and r.path.endswith("/config.json")]
    assert heads[:4] == [503, 503, 503, 200]


def test_a_5xx_during_the_transfer_stores_nothing_and_says_so(online_hub):
    server = online_hub.server
    files = hub_files(8)
    server.add("someone/broken-cdn", files)
    server.fail(action="status", status=500, method="GET", server="cdn", times=1)
    with pytest.raises(WeightsError, match=r"downloading model\.safetensors of 'someone/broken-cdn' from the Hugging Face "
                                           r"hub repo someone/broken-cdn@main failed part-way \(HTTP 500\); nothing of it "
                                           r"was stored in the cache \(.*\)\.\nFix: run `lopt weights download "
                                           r"someone/broken-cdn` again"):
        load_weights("someone/broken-cdn", ARCH)
    assert "model.safetensors" not in "".join(cache_files(online_hub, "someone/broken-cdn"))
    assert_same_tensors(load_weights("someone/broken-cdn", ARCH), 8)  # the hub is fine again: the next try works


@pytest.mark.parametrize("faults,outcome", [
    ([dict(action="cut")], "resumed"),  # the connection drops half-way once: huggingface_hub tries again
    ([dict(action="cut"), dict(action="status", status=500, method="GET")], "HTTP 500"),  # ... and then fails
    ([dict(action="short")], "OSError: Consistency check failed"),  # fewer bytes than the hub announced
])
def test_a_download_cut_off_half_way_is_never_loaded(online_hub, registered, monkeypatch, faults, outcome):
    import huggingface_hub.constants as hub_constants

    # huggingface_hub writes what it received in chunks of DOWNLOAD_CHUNK_SIZE (10 MiB); small chunks make the
    # half it got before the cut reach its temporary file, so that it resumes with a Range request
    monkeypatch.setattr(hub_constants, "DOWNLOAD_CHUNK_SIZE", 512)
    server = online_hub.server
    files = hub_files(9)
    server.add("someone/cut", files)
    registered("lopt-online-cut", "someone/cut", {"config.json": None, "model.safetensors": file_info(files["model.safetensors"])})
    for fault in faults:
        server.fail(server="cdn", **fault)
    started = time.monotonic()
    if outcome == "resumed":
        assert_same_tensors(load_weights("lopt-online-cut", ARCH), 9)  # whole, and its sha256 checked
        first, second = [r for r in server.requests if r.server == "cdn" and r.method == "GET"]
        assert first.range is None and first.status == 200
        received = int(second.range.removeprefix("bytes=").removesuffix("-"))
        assert 0 < received <= len(files["model.safetensors"]) // 2 and second.status == 206  # resumed where it broke
    else:
        with pytest.raises(WeightsError, match=rf"downloading model\.safetensors of 'lopt-online-cut' .* failed part-way "
                                               rf"\({re.escape(outcome)}.*\); nothing of it was stored in the cache"):
            load_weights("lopt-online-cut", ARCH)
        stored = cache_files(online_hub, "someone/cut")
        assert not any("model.safetensors" in name or name.endswith(".incomplete") for name in stored), stored
        assert sum(size == len(files["model.safetensors"]) // 2 for size in stored.values()) == 0
        assert W.cached_status("lopt-online-cut") == "partly cached"
        assert_same_tensors(load_weights("lopt-online-cut", ARCH), 9)  # the next try downloads it whole
    assert time.monotonic() - started < 10


def test_checksum_mismatch_from_the_hub_and_in_the_cache(online_hub, registered, capsys):
    server = online_hub.server
    published = hub_files(10)
    impostor = hub_files(11)  # same shapes, same size, other values
    assert len(impostor["model.safetensors"]) == len(published["model.safetensors"])
    server.add("someone/sums", impostor)
    registered("lopt-online-sums", "someone/sums", {"config.json": None,
                                                   "model.safetensors": file_info(published["model.safetensors"])})
    expected = hashlib.sha256(published["model.safetensors"]).hexdigest()
    with pytest.raises(WeightsError, match=rf"checksum mismatch for .*model\.safetensors:\nsha256 "
                                           rf"{hashlib.sha256(impostor['model.safetensors']).hexdigest()}, expected {expected}"):
        lopt.SmallFCLOpt([torch.zeros(2, requires_grad=True)], weights="lopt-online-sums")
    code, _, err = run_cli(capsys, "weights", "download", "lopt-online-sums")
    assert code == 2 and "checksum mismatch" in err

    # the hub gets the published file; then the cached copy is damaged on disk: only --force repairs it
    server.add("someone/sums", published)
    assert_same_tensors(load_weights("lopt-online-sums", ARCH), 10)
    blob = online_hub.cache / "models--someone--sums" / "blobs" / expected
    damaged = bytearray(blob.read_bytes())
    damaged[-1] ^= 0x01
    blob.write_bytes(bytes(damaged))
    with pytest.raises(WeightsError, match=r"checksum mismatch(.|\n)*\(`lopt weights download lopt-online-sums --force`\)$"):
        load_weights("lopt-online-sums", ARCH)
    code, _, err = run_cli(capsys, "weights", "download", "lopt-online-sums")
    assert code == 2 and "checksum mismatch" in err  # the hub's file is unchanged, so the cached one is reused
    code, out, err = run_cli(capsys, "weights", "download", "lopt-online-sums", "--force")
    assert code == 0, err
    assert blob.read_bytes() == published["model.safetensors"]
    assert_same_tensors(load_weights("lopt-online-sums", ARCH), 10)


# ------------------------------------------------------------------------------------------ offline and down


def test_offline_and_hub_down_fall_back_to_the_cache(online_hub, monkeypatch, capsys):
    import huggingface_hub.constants as hub_constants

    server = online_hub.server
    server.add("someone/cached", hub_files(12))
    assert_same_tensors(load_weights("someone/cached", ARCH), 12)

    # HF_HUB_OFFLINE: the cache alone, not a single request
    before = len(server.requests)
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    assert_same_tensors(load_weights("someone/cached", ARCH), 12)
    assert len(server.requests) == before
    code, _, err = run_cli(capsys, "weights", "download", "someone/cached", "--force")
    assert code == 2 and "cannot download 'someone/cached' again while HF_HUB_OFFLINE is set" in err
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)

    # the hub goes down (connections refused): the cached weights load at once, uncached ones fail at once
    server.stop()
    started = time.monotonic()
    assert_same_tensors(load_weights("someone/cached", ARCH), 12)
    with pytest.raises(WeightsError, match=(
            rf"cannot get config\.json of 'someone/other' from the Hugging Face hub repo someone/other@main: the hub at "
            rf"{re.escape(online_hub.endpoint)} is unreachable \(\w+: .*\) and the file is not in the cache")):
        load_weights("someone/other", ARCH)
    code, _, err = run_cli(capsys, "weights", "download", "someone/cached", "--force")
    assert code == 2 and (f"cannot download 'someone/cached' again (someone/cached@main): the hub at {online_hub.endpoint} "
                          f"is unreachable") in err and "the cached copy, if any, is unchanged" in err
    assert time.monotonic() - started < FAST_S
    assert_same_tensors(load_weights("someone/cached", ARCH), 12)  # --force that failed left the cache as it was


def test_the_quick_start_fails_fast_and_says_what_to_do_when_the_hub_is_unreachable(unreachable_hub):
    """README's quick start, the Trainer and timm recipes all construct the optimizer with the published weights."""
    model = torch.nn.Linear(4, 2)
    for make, name in ((lambda: lopt.SmallFCLOpt(model.parameters()), "small_fc_lopt"),
                       (lambda: lopt.VeLO(model.parameters(), num_steps=100), "velo")):
        started = time.monotonic()
        with pytest.raises(WeightsError) as raised:
            make()
        assert time.monotonic() - started < FAST_S
        message = str(raised.value)
        first, *fixes = message.splitlines()
        assert re.fullmatch(rf"cannot get config\.json of '{name}' from the Hugging Face hub repo \S+@main: the hub at "
                            rf"{re.escape(unreachable_hub)} is unreachable \(\w+: .*\) and the file is not in the cache "
                            r"\(.*\)\.", first), first
        assert fixes == [
            "Fix:",
            f"  - run `lopt weights download {name}` on a machine with internet and copy its HF cache (HF_HOME) here",
            "  - or pass weights=<a local directory with config.json + model.safetensors, or a .safetensors file>",
            "  - once the cache is filled, set HF_HUB_OFFLINE=1: lopt then reads it without trying the network",
            *(["  - or weights='lopt-small_fc-tiny': lopt's own meta-trained weights, shipped with it, train offline"]
              if name == "small_fc_lopt" else []),
            f"  - for timing only: weights=lopt.random_weights('{name}') (untrained: it does not train)"]
        assert max(len(line) for line in fixes) < 120
