"""The lopt command: exit codes and the lines a user reads."""

import json
import subprocess
import sys

import pytest
import torch

import lopt
from lopt import cli
from lopt import weights as weights_lib
from hub_cache import hub_layout_files


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_version_through_the_console_entry_point():
    result = subprocess.run([sys.executable, "-m", "lopt.cli", "--version"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == f"lopt {lopt.__version__}"


def test_info_reports_backends_and_weights(capsys, offline_hub):
    code, out, _ = run(capsys, "info")
    assert code == 0
    assert f"lopt {lopt.__version__}  torch {torch.__version__}" in out
    assert "small_fc_lopt: naive available; fused " in out
    assert "velo: naive available; fused " in out
    if not torch.cuda.is_available():
        assert "fused unavailable: no CUDA device is available to PyTorch" in out
    assert "small_fc_lopt [small_fc_lopt] btherien/mulo@main: not cached" in out


def test_weights_list_shows_cache_status(capsys, offline_hub, tmp_path):
    lopt.random_weights("small_fc_lopt").save(tmp_path / "w")
    offline_hub.add("btherien/mulo", hub_layout_files(tmp_path / "w"))
    code, out, _ = run(capsys, "weights", "list")
    assert code == 0
    rows = {line.split("\t")[0]: line.split("\t") for line in out.strip().splitlines()}
    assert rows["small_fc_lopt"][2:4] == ["btherien/mulo@main", "cached"]
    assert rows["velo"][3] == "not cached"


def test_weights_verify_ok_and_errors(capsys, tmp_path):
    lopt.random_weights("small_fc_lopt").save(tmp_path / "good")
    code, out, _ = run(capsys, "weights", "verify", str(tmp_path / "good"))
    assert code == 0 and "holds valid small_fc_lopt weights (6 tensors)" in out
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "model.safetensors").write_bytes(b"not a safetensors file")
    code, _, err = run(capsys, "weights", "verify", str(tmp_path / "bad"), "--architecture", "small_fc_lopt")
    assert code == 2 and "model.safetensors is not a safetensors file" in err


def test_weights_download_offline_and_registered(capsys, offline_hub, tmp_path):
    code, _, err = run(capsys, "weights", "download", "small_fc_lopt")
    assert code == 2 and "HF_HUB_OFFLINE is set and the file is not in the cache" in err
    code, _, err = run(capsys, "weights", "download", "no_such_weights")
    assert code == 2 and "no registered weights named 'no_such_weights'" in err
    weights = lopt.random_weights("small_fc_lopt", seed=3)
    weights.save(tmp_path / "w")
    snapshot = offline_hub.add("someone/my-lopt", hub_layout_files(tmp_path / "w"))
    entry = weights_lib.RegisteredWeights("my_lopt", "small_fc_lopt", "test",
                                          {"mlp": weights_lib.PublishedComponent("someone/my-lopt", "main",
                                                                                 {"config.json": None, "model.safetensors": None})})
    weights_lib.register_weights(entry)
    try:
        code, out, _ = run(capsys, "weights", "download", "my_lopt")
    finally:
        weights_lib.unregister_weights("my_lopt")
    assert code == 0 and out.strip() == str(snapshot)


def test_bench_on_cpu_with_untrained_weights(capsys, offline_hub, tmp_path):
    out_json = tmp_path / "bench.json"
    code, out, _ = run(capsys, "bench", "--device", "cpu", "--params", "tiny-lm", "--steps", "2", "--warmup", "1",
                       "--quiet", "--json", str(out_json))
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("pretrained weights unavailable (cannot get config.json of 'small_fc_lopt'")
    assert lines[0].endswith("using untrained weights — timing only")
    assert "small_fc_lopt on tiny-lm (28 tensors) on cpu, weights: random (seed 0) (untrained weights — timing only)" in out
    assert "fused backend skipped: the parameters are not all on a CUDA device" in out
    table_row = next(line for line in lines if line.startswith("small_fc_lopt  naive"))
    assert float(table_row.split()[3]) > 0
    record = json.loads(out_json.read_text())
    assert record["pretrained"] is False
    assert [(r["optimizer"], r["backend"], r["param_set"]) for r in record["results"]] == [("small_fc_lopt", "naive", "tiny-lm")]
    assert len(record["results"][0]["ms_all"]) == 2 and record["environment"]["torch"] == torch.__version__


def test_bench_without_cuda_says_why_fused_is_skipped(capsys, offline_hub, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, out, _ = run(capsys, "bench", "--params", "tiny-lm", "--steps", "1", "--warmup", "0", "--quiet")
    assert code == 0
    assert "on cpu" in out and "fused backend skipped: no CUDA device is available to PyTorch" in out


def test_bench_require_pretrained_fails_clearly(capsys, offline_hub):
    code, _, err = run(capsys, "bench", "--device", "cpu", "--params", "tiny-lm", "--steps", "1", "--quiet",
                       "--require-pretrained")
    assert code == 2 and "btherien/mulo" in err and "HF_HUB_OFFLINE is set" in err


def test_bench_with_local_weights_and_velo(capsys, tmp_path):
    lopt.random_weights("small_fc_lopt", seed=1).save(tmp_path / "sfc")
    code, out, _ = run(capsys, "bench", "--device", "cpu", "--params", "tiny-lm", "--steps", "1", "--warmup", "0",
                       "--quiet", "--weights", str(tmp_path / "sfc"))
    assert code == 0 and f"weights: {tmp_path / 'sfc'}" in out and "untrained" not in out
    velo = lopt.random_weights("velo", seed=1)
    velo.save({"rnn": tmp_path / "rnn", "mlp": tmp_path / "mlp"})
    code, _, err = run(capsys, "bench", "--optimizer", "velo", "--device", "cpu", "--params", "tiny-lm", "--steps", "1",
                       "--warmup", "1", "--quiet", "--weights", str(tmp_path / "rnn"))
    assert code == 2 and "velo has 2 networks (rnn, mlp)" in err  # one directory is not enough
    code, out, _ = run(capsys, "bench", "--optimizer", "velo", "--device", "cpu", "--params", "tiny-lm", "--steps", "1",
                       "--warmup", "1", "--quiet", "--weights", str(tmp_path / "rnn"), str(tmp_path / "mlp"))
    assert code == 0 and "velo on tiny-lm" in out
    assert next(line for line in out.splitlines() if line.startswith("velo "))


@pytest.mark.parametrize("argv", [["bench", "--params", "resnet-9000"], ["weights"], ["frobnicate"]])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
