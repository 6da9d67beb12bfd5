"""The lopt command: exit codes and the lines a user reads."""

import signal
import subprocess
import sys

import pytest
import torch

import lopt
from lopt import registry
from lopt import cli
from lopt import weights as weights_lib
from hub_cache import hub_layout_files


def run(capsys, *argv):
    """(exit code, stdout, stderr) of ``lopt ARGV`` (argparse's own errors exit through SystemExit)."""
    try:
        code = cli.main([str(a) for a in argv])
    except SystemExit as exit_info:
        code = exit_info.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def no_benchmark(monkeypatch):
    """Fail the test if a benchmark starts: the errors under test must come before any work."""
    from lopt.bench import runner

    def started(*args, **kwargs):
        raise AssertionError("the benchmark ran although the options were invalid")

    monkeypatch.setattr(runner, "run_benchmarks", started)


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
    lines = out.strip().splitlines()
    assert lines[0] == "name\tarchitecture\tsource\tcache\tdescription"
    rows = {line.split("\t")[0]: line.split("\t") for line in lines[1:]}
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


def _velo_pair(tmp_path):
    lopt.random_weights("velo", seed=2).save({"rnn": tmp_path / "rnn", "mlp": tmp_path / "mlp"})
    return tmp_path / "rnn", tmp_path / "mlp"


def test_weights_verify_velo_pair(capsys, tmp_path):
    rnn, mlp = _velo_pair(tmp_path)
    try:  # lopt.weights.verify takes VeLO's (rnn, mlp) pair as one source once that change has landed
        weights_lib.verify((str(rnn), str(mlp)))
    except (TypeError, weights_lib.WeightsError) as err:
        pytest.skip(f"lopt.weights.verify does not take VeLO's pair yet: {err}")
    tensors = sum(len(t) for t in lopt.random_weights("velo").tensors.values())
    code, out, _ = run(capsys, "weights", "verify", rnn, mlp)
    assert code == 0 and out.strip() == f"ok: {rnn} + {mlp} holds valid velo weights ({tensors} tensors)"
    code, _, err = run(capsys, "weights", "verify", mlp, rnn, "--architecture", "velo")
    assert code == 2 and "does not hold the rnn network" in err  # the order is RNN, then MLP


def test_weights_verify_takes_at_most_two_paths(capsys, tmp_path):
    rnn, mlp = _velo_pair(tmp_path)
    code, out, err = run(capsys, "weights", "verify", rnn, mlp, mlp)
    assert code == 2 and out == ""
    assert err.strip() == "lopt weights: error: lopt weights verify takes one path, or two for VeLO (RNN and MLP), got 3"


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


def _bench_lines(out):
    return out.splitlines()


def _table_rows(out):
    """{(optimizer, contender, params): cells} of the printed table."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("optimizer "))
    rows = {}
    for line in lines[start + 2:]:
        if not line or line.startswith("[") or line.startswith("loss curves") or line.startswith("wrote "):
            break
        cells = line.split()
        if cells[0] == "adamw":  # "adamw (foreach)" is two words
            cells = [cells[0], " ".join(cells[1:3])] + cells[3:]
        rows[(cells[0], cells[1], cells[2])] = cells[3:]
    return rows


def test_bare_bench_on_a_cpu_machine(capsys, offline_hub, monkeypatch):
    """No options, no GPU: every optimizer's naive step and AdamW (foreach) on tiny-lm; fused listed with the reason."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, out, err = run(capsys, "bench", "--steps", "1", "--warmup", "0", "--quiet")
    assert code == 0, err
    lines = out.splitlines()
    # small_fc_lopt and MuLO fall back to the weights that ship with lopt (they train); the others to random ones
    assert ("pretrained weights unavailable (cannot get config.json of 'small_fc_lopt' from the Hugging Face hub repo "
            "btherien/mulo@main): using 'lopt-small_fc-tiny', lopt's own weights shipped with it") in lines
    for name in ("small_fc_lopt", "mulo"):
        assert f"{name} weights: lopt-small_fc-tiny (lopt/_registry/lopt-small_fc-tiny (ships with lopt))" in lines
    for name, repo in (("velo", "Pauljanson002/VeLO_RNN@main"), ("elo", "DiamondXL/elo@main")):
        assert (f"pretrained weights unavailable (cannot get config.json of {name!r} from the Hugging Face hub repo "
                f"{repo}): using untrained weights — timing only") in lines
        assert f"{name} weights: random (seed 0) (untrained weights — timing only)" in lines
    assert "step mode on cpu (" in out and "time per optimizer step on tiny-lm (28 tensors, 0.56 M)" in out
    rows = _table_rows(out)
    assert float(rows[("adamw", "adamw (foreach)", "tiny-lm")][0]) > 0
    for name in registry.names():
        naive = rows[(name, "naive", "tiny-lm")]
        # (a one-step time on a busy CPU: the sign of naive's overhead over AdamW is noise, its form is not)
        assert float(naive[0]) > 0 and naive[2][0] in "+-" and naive[2].endswith("%")
        low, high = (float(x) for x in naive[1].split("-"))  # the timed steps' range around the median
        assert low <= float(naive[0]) <= high
        assert rows[(name, "fused", "tiny-lm")][:2] == ["not", "run"]
        assert rows[(name, "naive+compile", "tiny-lm")][:2] == ["not", "run"]
    notes = [line for line in lines if line.startswith("[")]
    assert any(n.endswith("] no CUDA device is available to PyTorch") for n in notes)
    assert any("not selected: compiling the naive step takes minutes" in n for n in notes)


@pytest.mark.parametrize("terminal", [True, False])
def test_bench_progress_bars_are_drawn_only_on_a_terminal(terminal, monkeypatch):
    """A redirected stderr (a log file, CI) gets none of a progress bar's redrawn frames; a terminal gets the bar,
    and --quiet turns it off there too."""
    import io

    from lopt.bench.runner import make_progress_factory

    class Stream(io.StringIO):
        def isatty(self):
            return terminal

    for enabled in (True, False):
        stream = Stream()
        monkeypatch.setattr(sys, "stderr", stream)
        bar = make_progress_factory(enabled)(3, "celo2 naive tiny-lm")
        for _ in range(3):
            bar.update(1)
        bar.close()
        monkeypatch.undo()
        drawn = "celo2 naive tiny-lm" in stream.getvalue()
        assert drawn == (terminal and enabled), (terminal, enabled, stream.getvalue())


def test_bench_require_pretrained_fails_clearly(capsys, offline_hub, no_benchmark):
    code, _, err = run(capsys, "bench", "--device", "cpu", "--params", "tiny-lm", "--steps", "1", "--quiet",
                       "--optimizer", "small_fc_lopt", "--require-pretrained")
    assert code == 2 and "btherien/mulo" in err and "HF_HUB_OFFLINE is set" in err


def test_bench_with_local_weights_and_velo(capsys, tmp_path):
    lopt.random_weights("small_fc_lopt", seed=1).save(tmp_path / "sfc")
    code, out, _ = run(capsys, "bench", "--device", "cpu", "--params", "toy-lm", "--steps", "1", "--warmup", "0",
                       "--quiet", "--optimizer", "small_fc_lopt", "--weights", tmp_path / "sfc")
    assert code == 0 and f"small_fc_lopt weights: {tmp_path / 'sfc'}\n" in out and "untrained" not in out
    rnn, mlp = _velo_pair(tmp_path)
    code, _, err = run(capsys, "bench", "--optimizer", "velo", "--device", "cpu", "--params", "toy-lm", "--steps", "1",
                       "--warmup", "0", "--quiet", "--weights", rnn)
    assert code == 2 and "velo has 2 networks (rnn, mlp)" in err  # one directory is not enough
    code, out, _ = run(capsys, "bench", "--optimizer", "velo", "--device", "cpu", "--params", "toy-lm", "--steps", "1",
                       "--warmup", "0", "--quiet", "--weights", rnn, mlp)
    assert code == 0 and f"velo weights: rnn={rnn}, mlp={mlp}" in out
    assert float(_table_rows(out)[("velo", "naive", "toy-lm")][0]) > 0


BAD_OPTIONS = [
    (["--steps", "0"], "argument --steps: must be a positive integer, got 0"),
    (["--steps", "-5"], "argument --steps: must be a positive integer, got -5"),
    (["--steps", "many"], "argument --steps: must be a positive integer, got 'many'"),
    (["--warmup", "-1"], "argument --warmup: must be an integer >= 0, got -1"),
    (["--backends", "foo"], "argument --backends: unknown contender 'foo'; choose from adamw, muon, naive, naive+compile, "
                            "fused, fused-fast (comma-separated)"),
    (["--backends", ","], "argument --backends: needs at least one contender"),
    (["--params", "resnet-9000"], "argument --params: unknown parameter set 'resnet-9000'"),
    (["--optimizer", "sgd"], "argument --optimizer: invalid choice: 'sgd'"),
    (["--plot", "times.jpg"], "argument --plot: must be a .png file name, got 'times.jpg'"),
    (["--curves-steps", "1"], "argument --curves-steps: must be an integer >= 2, got 1"),
    (["--mode", "iteration", "--dtype", "bfloat16"], "--dtype applies to --mode step"),
    (["--batch-size", "4"], "--batch-size applies to --mode iteration"),
    (["--mode", "iteration", "--params", "tiny-lm", "--seq-len", "300"],
     "--seq-len 300: tiny-lm has 256 positions; use --seq-len 256 or less"),
    (["--mode", "iteration", "--params", "vit-b16", "--seq-len", "16"], "--seq-len: vit-b16 is not a language model"),
    (["--weights", "somewhere"], "--weights needs one --optimizer (small_fc_lopt or velo)"),
    (["--optimizer", "velo", "--weights", "a", "b", "c"], "--weights takes one path, or two for VeLO"),
    (["--curves-lr", "0"], "argument --curves-lr: must be a positive number, got 0"),
    (["--curves-lr", "nan"], "argument --curves-lr: must be a positive number, got nan"),
    (["--curves-lr", "fast"], "argument --curves-lr: must be a positive number, got 'fast'"),
    (["--curves-weight-decay", "-0.1"], "argument --curves-weight-decay: must be a number >= 0, got -0.1"),
    (["--curves-lr", "0.05"], "--curves-lr applies only with --curves FILE.png"),
    (["--curves-weight-decay", "0"], "--curves-weight-decay applies only with --curves FILE.png"),
    (["--curves-steps", "5"], "--curves-steps applies only with --curves FILE.png"),
    (["--curves-model", "toy-lm"], "--curves-model applies only with --curves FILE.png"),
    (["--curves", "c.png", "--curves-model", "vit-b16"], "--curves-model vit-b16: the loss curves train a language model"),
]


@pytest.mark.parametrize("options,message", BAD_OPTIONS, ids=[" ".join(o) for o, _ in BAD_OPTIONS])
def test_bench_bad_options_are_one_line_errors_before_any_work(options, message, capsys, offline_hub, no_benchmark,
                                                                 tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # --curves c.png would be created here
    code, out, err = run(capsys, "bench", "--device", "cpu", *options)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("lopt bench: error: ") and message in err


def test_bench_device_cuda_without_a_gpu(capsys, monkeypatch, no_benchmark):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, out, err = run(capsys, "bench", "--device", "cuda")
    assert code == 2 and out == ""
    assert err.startswith("lopt bench: error: --device cuda: no CUDA device is available to PyTorch (torch ")
    assert err.rstrip().endswith("use --device cpu or leave --device out") and len(err.strip().splitlines()) == 1


def test_bench_fused_only_without_a_gpu_is_an_error(capsys, offline_hub, monkeypatch, no_benchmark):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, out, err = run(capsys, "bench", "--backends", "fused")
    assert code == 2 and "wrote" not in out
    assert err.strip().startswith("lopt bench: error: nothing to run with --backends fused: small_fc_lopt fused: no "
                                  "CUDA device is available to PyTorch; velo fused: no CUDA device is available to "
                                  "PyTorch")
    reasons = [f"{name} fused: " + ("no CUDA device is available to PyTorch" if registry.get(name).fused else
                                    f"lopt has no fused kernels for {registry.get(name).architecture} yet")
               for name in registry.names()]  # (every registered optimizer's, in registration order)
    assert err.strip() == "lopt bench: error: nothing to run with --backends fused: " + "; ".join(reasons)


@pytest.mark.parametrize("option", ["--json", "--markdown", "--plot", "--curves"])
def test_bench_unwritable_output_fails_before_the_benchmark(option, capsys, tmp_path, no_benchmark):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    target = blocker / "out.png"
    code, out, err = run(capsys, "bench", "--device", "cpu", option, target)
    assert code == 2 and out == ""
    assert err.startswith(f"lopt bench: error: {option} {target}: cannot write there (")
    (tmp_path / "dir.png").mkdir()
    code, _, err = run(capsys, "bench", "--device", "cpu", option, tmp_path / "dir.png")
    assert code == 2 and err.strip() == f"lopt bench: error: {option} {tmp_path / 'dir.png'}: is a directory; give a file name"


@pytest.mark.parametrize("module,argv,message", [
    ("timm", ["--mode", "iteration", "--params", "vit-b16"],
     "--mode iteration with vit-b16 needs timm, which cannot be imported (ModuleNotFoundError: "),
    ("transformers", ["--mode", "iteration", "--params", "tiny-lm"],
     "--mode iteration with tiny-lm needs transformers, which cannot be imported (ModuleNotFoundError: "),
    ("transformers", ["--curves", "c.png"],
     "--curves with gpt2-1x64 needs transformers, which cannot be imported"),
    ("matplotlib", ["--plot", "p.png"], "--plot needs matplotlib, which cannot be imported (ModuleNotFoundError: "),
])
def test_bench_missing_optional_library_is_one_line(module, argv, message, capsys, monkeypatch, tmp_path, no_benchmark):
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` fail, whether or not it is installed
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, "bench", "--device", "cpu", *argv)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith("lopt bench: error: " + message), err
    assert "pip install" in err


@pytest.mark.parametrize("argv", [["weights"], ["frobnicate"], ["weights", "verify"]])
def test_other_bad_arguments_exit_2_with_one_line(argv, capsys):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "error:" in err


def test_bench_refuses_two_outputs_in_one_file(capsys, tmp_path, no_benchmark):
    target = tmp_path / "results.txt"
    code, out, err = run(capsys, "bench", "--device", "cpu", "--json", target, "--markdown", target)
    assert code == 2 and out == ""
    assert err.strip() == (f"lopt bench: error: --json and --markdown both name {target}: one would overwrite the "
                           f"other; give each output its own file")
    code, _, err = run(capsys, "bench", "--device", "cpu", "--plot", tmp_path / "p.png", "--curves",
                       tmp_path / "sub" / ".." / "p.png")  # the same file, spelled otherwise
    assert code == 2 and "--plot and --curves both name" in err
    assert not target.exists() and not (tmp_path / "p.png").exists()


def test_bench_interrupted_exits_130_in_one_line_and_removes_what_it_created(capsys, tmp_path, monkeypatch):
    from lopt.bench import runner

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "run_benchmarks", interrupted)
    lopt.random_weights("small_fc_lopt").save(tmp_path / "w")
    kept = tmp_path / "existing.md"
    kept.write_text("mine")
    new_dir = tmp_path / "out" / "run1"
    code, _, err = run(capsys, "bench", "--device", "cpu", "--optimizer", "small_fc_lopt", "--weights", tmp_path / "w",
                       "--params", "toy-lm", "--quiet", "--json", new_dir / "r.json", "--markdown", kept)
    assert code == 130
    assert err.strip() == f"lopt bench: interrupted; removed {new_dir}/, {tmp_path / 'out'}/"
    assert not (tmp_path / "out").exists() and kept.read_text() == "mine"  # what existed before stays


def test_bench_interrupt_that_python_wrapped_in_another_error_still_exits_130(capsys, tmp_path, monkeypatch):
    """A Ctrl-C landing in a class body's __set_name__ (a lazy import, e.g. torch._dynamo's on the first optimizer)
    reaches the CLI as a RuntimeError caused by the KeyboardInterrupt; any other error still propagates."""
    from lopt.bench import runner

    class Interrupting:
        def __set_name__(self, owner, name):
            raise KeyboardInterrupt

    def interrupted_in_an_import(*args, **kwargs):
        type("Imported", (), {"attribute": Interrupting()})  # Python turns the interrupt into a RuntimeError

    monkeypatch.setattr(runner, "run_benchmarks", interrupted_in_an_import)
    lopt.random_weights("small_fc_lopt").save(tmp_path / "w")
    new_dir = tmp_path / "out"
    argv = ("bench", "--device", "cpu", "--optimizer", "small_fc_lopt", "--weights", tmp_path / "w", "--params",
            "toy-lm", "--quiet", "--json", new_dir / "r.json")
    handler = signal.getsignal(signal.SIGINT)
    code, _, err = run(capsys, *argv)
    assert code == 130 and err.strip() == f"lopt bench: interrupted; removed {new_dir}/"
    assert not new_dir.exists()
    assert signal.getsignal(signal.SIGINT) is handler  # Ctrl-C works again in a program that called main()

    def broken(*args, **kwargs):
        try:
            raise KeyError("unrelated")
        except KeyError as cause:
            raise RuntimeError("a real bug") from cause

    monkeypatch.setattr(runner, "run_benchmarks", broken)
    with pytest.raises(RuntimeError, match="a real bug"):
        run(capsys, *argv)


def test_ctrl_c_in_a_running_bench_exits_130_without_a_traceback(tmp_path, offline_hub):
    """SIGINT to the real command while it times steps (a run that would take minutes)."""
    import signal
    import time

    env = dict(__import__("os").environ, **offline_hub.env(), PYTHONUNBUFFERED="1")
    output = tmp_path / "out" / "r.json"
    # As the `lopt` console script runs it (import lopt.cli, sys.exit(main())), with Python's own SIGINT handler:
    # a process started in the background inherits an ignored SIGINT, which Python then leaves ignored.
    entry = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
             "from lopt.cli import main; sys.exit(main())")
    process = subprocess.Popen([sys.executable, "-c", entry, "bench", "--device", "cpu", "--optimizer", "small_fc_lopt",
                                "--params", "tiny-lm", "--backends", "naive", "--no-adamw", "--steps", "100000",
                                "--quiet", "--json", str(output)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=env)
    try:
        deadline = time.monotonic() + 60
        for line in process.stdout:  # the header comes just before the timing starts
            if line.startswith("step mode on cpu") or time.monotonic() > deadline:
                break
        time.sleep(0.5)
        process.send_signal(signal.SIGINT)
        try:
            _, err = process.communicate(timeout=15)
        except subprocess.TimeoutExpired:  # (an interrupt that native code swallowed: a user presses Ctrl-C again)
            process.send_signal(signal.SIGINT)
            _, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
    assert process.returncode == 130, err
    assert err.strip().splitlines()[-1] == f"lopt bench: interrupted; removed {output.parent}/"
    assert "Traceback" not in err and not output.parent.exists()
