"""lopt.meta's outer loop on the CPU: the meta-loss goes down, checkpoints resume bit-exactly, the weights load."""

import json
import math
import statistics

import pytest
import torch

import lopt
from lopt.meta.presets import MetaTrainConfig, preset
from lopt.meta.trainer import CHECKPOINT, RECORD, MetaTrainer


@pytest.mark.usefixtures("single_intra_op_thread")
def test_meta_loss_goes_down_on_a_tiny_population(tmp_path):
    """40 PES outer steps of the smoke preset (logistic regression, random initial meta-weights, fixed seed):
    the meta-loss's last 10 steps average well below its first 10, and the validation loss of θ itself
    (fixed instances, no perturbation) drops too. (Seeds 0-2 measured: first 10 ≈ 1.24-1.35, last 10 ≈
    0.61-0.86; validation 1.31-1.34 → 0.64-0.78.)"""
    trainer = MetaTrainer(preset("smoke", seed=0), out_dir=tmp_path, device="cpu")
    summary = trainer.run(progress=False)
    assert summary["finished"] and summary["step"] == 40
    losses = trainer.history["meta_loss"]
    first, last = statistics.mean(losses[:10]), statistics.mean(losses[-10:])
    assert last < first - 0.2, (first, last)
    validation = trainer.history["validation"]
    assert validation[0][0] == 0 and validation[-1][0] == 40
    assert validation[-1][1] < validation[0][1] - 0.3, validation
    # the output: PyLO's hub layout beside the record, loadable by SmallFCLOpt
    assert (tmp_path / "config.json").is_file() and (tmp_path / "model.safetensors").is_file()
    record = json.loads((tmp_path / RECORD).read_text())
    assert record["history"]["meta_loss"] == losses and record["config"]["preset"] == "smoke"
    assert record["outer_steps_done"] == 40 and record["inner_steps_per_second"] > 0
    model = torch.nn.Linear(3, 2)
    opt = lopt.SmallFCLOpt(model.parameters(), weights=str(tmp_path), backend="naive")
    loaded = opt.meta_weights.tensors["mlp"]
    for name, tensor in trainer.space.unflatten(trainer.theta.detach()).items():
        assert torch.equal(loaded[name], tensor)
    best = lopt.load_weights(str(tmp_path / "best"), "small_fc_lopt")
    assert best.tensors["mlp"]["network.input.weight"].shape == (32, 39)


def _equal_states(a, b):
    if torch.is_tensor(a):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal_states(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal_states(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.usefixtures("single_intra_op_thread")
@pytest.mark.parametrize("estimator", ["pes", "es"])
def test_checkpoint_resume_is_bit_exact(tmp_path, estimator):
    """N outer steps straight == N/2, checkpoint, a new process-like resume from the directory, N/2 more:
    identical θ, AdamW state, PES state (inner parameters, optimizer state, accumulators, positions), with an
    unroll curriculum running across the break."""
    config = preset("smoke", estimator=estimator, outer_steps=12, validate_every=0, min_unroll=10, max_unroll=30,
                    tasks=[{"task": "mlp", "dataset": "mnist1d", "hidden": [8], "batch_size": 16,
                            "rescale": [0.1, 10.0]},
                           {"task": "teacher_student", "in_dim": 4, "out_dim": 2, "teacher_hidden": [8],
                            "student_hidden": "random", "batch_size": 16}],
                    num_tasks=2, groups_per_step=1, curriculum_from=15, curriculum_steps=8)
    straight = MetaTrainer(config, out_dir=tmp_path / "straight")
    straight.run(progress=False)

    first = MetaTrainer(config, out_dir=tmp_path / "chunks")
    summary = first.run(progress=False, outer_steps=6)
    assert summary["step"] == 6 and not summary["finished"]
    del first
    resumed = MetaTrainer.resume(tmp_path / "chunks")
    assert resumed.step == 6
    resumed.run(progress=False)

    assert resumed.step == straight.step == 12
    assert torch.equal(resumed.theta.detach(), straight.theta.detach())
    a, b = straight.state_dict(), resumed.state_dict()
    for key in ("theta", "outer_opt", "estimators", "host_gen", "device_gen"):
        assert _equal_states(a[key], b[key]), key
    assert a["history"]["meta_loss"] == b["history"]["meta_loss"]
    assert {tuple(g) for g in a["history"]["groups"]} == {(0,), (1,)}  # both families, round robin
    if estimator == "pes":
        assert sum(a["history"]["resets"]) > 0  # instances reached the end of their unrolls and were replaced
    assert [c["to_step"] for c in resumed.chunks] == [6, 12]


def test_curriculum_max_unroll_at():
    config = preset("smoke", min_unroll=10, max_unroll=60, curriculum_from=15, curriculum_steps=20)
    assert [config.max_unroll_at(s) for s in (0, 10, 20, 35)] == [15, 30, 60, 60]  # 15·4^(s/20), then held
    assert preset("smoke", max_unroll=60).max_unroll_at(0) == 60  # no curriculum: max_unroll throughout


@pytest.mark.usefixtures("single_intra_op_thread")
@pytest.mark.parametrize("estimator", ["pes", "es"])
def test_curriculum_grows_the_longest_unroll_new_instances_draw(tmp_path, monkeypatch, estimator):
    """Under a curriculum every unroll length is drawn from [min_unroll, max_unroll_at(the outer step)], and the
    lengths PES gives its instances (rounded up to the truncation) never exceed that."""
    from lopt.meta import estimators

    config = preset("smoke", estimator=estimator, outer_steps=30, validate_every=0, truncation=5, min_unroll=10,
                    max_unroll=60, curriculum_from=15, curriculum_steps=20)
    trainer = MetaTrainer(config, out_dir=tmp_path)
    draws, original = [], estimators.log_uniform_int

    def recording(low, high, generator):
        length = original(low, high, generator)
        draws.append((trainer.step, low, high, length))
        return length

    monkeypatch.setattr(estimators, "log_uniform_int", recording)
    trainer.run(progress=False)
    assert all(low == 10 and high == config.max_unroll_at(step) and low <= n <= high for step, low, high, n in draws)
    assert {high for _, _, high, _ in draws} >= {15, 60}, draws  # from the start's bound to the full range
    if estimator == "pes":
        lengths = trainer.estimators[0].length
        assert all(n % 5 == 0 and n <= 60 for n in lengths)


@pytest.mark.usefixtures("single_intra_op_thread")
def test_patience_ends_the_run_after_validations_without_a_new_best(tmp_path, monkeypatch, capsys):
    """patience=2: the run ends at the second validation in a row that is no new best, stays ended on resume
    (a rerun takes no step), keeps the best weights, and says so in its summary, record and command output."""
    values = {0: 1.0, 2: 0.8, 4: 0.9, 6: 0.85, 8: 0.5, 10: 0.4}
    monkeypatch.setattr(MetaTrainer, "validate", lambda self, theta=None: values[self.step])
    monkeypatch.setattr(MetaTrainer, "validate_adamw", lambda self, lr: 1.0)
    config = preset("smoke", outer_steps=20, validate_every=2, patience=2)
    summary = MetaTrainer(config, out_dir=tmp_path).run(progress=False)
    assert summary["finished"] and summary["step"] == 6 and summary["best"] == [0.8, 2]
    assert summary["stopped_for"].startswith("no new best validation in 2 validations (best 0.8000 at outer step 2")
    record = json.loads((tmp_path / RECORD).read_text())
    assert record["stopped_early"] == 6 and record["history"]["validation"] == [[0, 1.0], [2, 0.8], [4, 0.9],
                                                                                [6, 0.85]]
    resumed = MetaTrainer.resume(tmp_path)
    again = resumed.run(progress=False)
    assert again["finished"] and again["step"] == 6 and resumed.stopped_early == 6
    best = lopt.load_weights(str(tmp_path / "best"), "small_fc_lopt").tensors["mlp"]
    at_step_2 = MetaTrainer(config, out_dir=tmp_path / "reference")
    at_step_2.run(progress=False, outer_steps=2)
    for name, tensor in at_step_2.space.unflatten(at_step_2.theta.detach()).items():
        assert torch.equal(best[name], tensor), name
    from lopt.cli import main

    assert main(["meta-train", "--preset", "smoke", "--out", str(tmp_path), "--device", "cpu", "--quiet",
                 "--set", "validate_every=2", "--set", "patience=2", "--outer-steps", "20"]) == 0
    assert "outer step 6/20, finished early: no new best validation in 2 validations" in capsys.readouterr().out


@pytest.mark.parametrize("overrides, message", [
    ({"curriculum_from": 5}, r"curriculum_from=5 lies outside \[min_unroll, max_unroll\] = \[20, 60\]"),
    ({"curriculum_from": 90}, r"curriculum_from=90 lies outside"),
    ({"curriculum_steps": 10}, r"curriculum_steps=10 without curriculum_from"),
    ({"patience": 3, "validate_every": 0}, r"patience=3 with validate_every=0: patience counts validations"),
    ({"min_unroll": 70}, r"min_unroll=70 and max_unroll=60: an unroll range needs"),
])
def test_config_errors_name_the_option(overrides, message):
    with pytest.raises(ValueError, match=message):
        MetaTrainer(preset("smoke", **overrides))


@pytest.mark.usefixtures("single_intra_op_thread")
def test_elo_meta_trains_with_elos_step_and_a_refused_optimizer_writes_nothing(tmp_path, capsys):
    """--optimizer elo: the tasks train with ELO's step (lopt.meta.batched, checked against lopt.ELO member by
    member in test_meta_batched.py), the weights load into lopt.ELO, the record says elo and meta-eval picks it up;
    an optimizer whose step is not batched is refused before anything is written."""
    from lopt.cli import main

    out = tmp_path / "elo"
    assert main(["meta-train", "--preset", "smoke", "--optimizer", "elo", "--out", str(out), "--quiet", "--device",
                 "cpu", "--set", "validate_every=0", "--outer-steps", "3"]) == 0
    assert f"lopt.ELO(weights='{out}')" in capsys.readouterr().out
    record = json.loads((out / RECORD).read_text())
    assert record["config"]["optimizer"] == "elo"
    trainer = MetaTrainer.resume(out, "cpu")
    assert trainer.estimators[0].inner.optimizer.rule.name == "elo"
    assert trainer.estimators[0].inner.optimizer.lr == 1e-3  # ELO's own step size, not small_fc_lopt's lr 1
    model = torch.nn.Linear(4, 3)
    elo = lopt.ELO(model.parameters(), weights=str(out), backend="naive")
    for name, tensor in trainer.space.unflatten(trainer.theta.detach()).items():
        assert torch.equal(elo.meta_weights.tensors["mlp"][name], tensor), name
    # the run's optimizer decides meta-eval's; asking for another is refused with the fix
    assert main(["meta-eval", str(out), "--quick", "--optimizer", "small_fc_lopt", "--quiet"]) == 2
    assert ("--optimizer small_fc_lopt: " + str(out) + " was meta-trained for elo") in capsys.readouterr().err
    assert main(["meta-eval", "lopt-small_fc-tiny", "--quick", "--optimizer", "elo", "--quiet"]) == 2
    assert "the registered weight set 'lopt-small_fc-tiny' says so" in capsys.readouterr().err

    for name, says in (("celo2", "its step (Newton–Schulz"), ("adamw", "is not a registered optimizer")):
        assert main(["meta-train", "--preset", "smoke", "--optimizer", name, "--out", str(tmp_path / name),
                     "--quiet", "--device", "cpu"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("lopt meta-train: error: lopt.meta steps populations of small_fc_lopt and elo only")
        assert says in err and not (tmp_path / name).exists()


def test_records_written_before_elo_read_as_small_fc_lopt():
    config = preset("smoke").to_dict()
    config["architecture"] = config.pop("optimizer")
    assert MetaTrainConfig.from_dict(config).optimizer == "small_fc_lopt"


@pytest.mark.usefixtures("single_intra_op_thread")
def test_max_minutes_stops_and_leaves_a_checkpoint(tmp_path):
    trainer = MetaTrainer(preset("smoke", outer_steps=10_000, validate_every=0), out_dir=tmp_path)
    summary = trainer.run(progress=False, max_minutes=0.02)
    assert summary["stopped_for"] == "time" and 0 < summary["step"] < 10_000
    assert summary["chunk_seconds"] < 0.02 * 60 + 1.0
    state = torch.load(tmp_path / CHECKPOINT, weights_only=True)
    assert state["step"] == summary["step"]


@pytest.mark.usefixtures("single_intra_op_thread")
def test_meta_train_command_runs_resumes_and_refuses_other_settings(tmp_path, capsys):
    from lopt.cli import main

    out = tmp_path / "run"
    common = ["meta-train", "--preset", "smoke", "--out", str(out), "--quiet", "--device", "cpu",
              "--set", "validate_every=0", "--set", "outer_steps=6"]
    assert main(common + ["--max-minutes", "0.001"]) == 0  # stops at once (after one step), checkpointed
    assert "rerun the same command to continue" in capsys.readouterr().out
    assert main(common) == 0
    printed = capsys.readouterr()
    assert "resuming" in printed.err and "outer step 6/6, finished" in printed.out
    assert json.loads((out / RECORD).read_text())["outer_steps_done"] == 6
    assert main(common + ["--seed", "3"]) == 2
    assert "other settings (seed)" in capsys.readouterr().err


@pytest.mark.usefixtures("single_intra_op_thread")
def test_sigterm_ends_the_chunk_after_the_current_step_with_a_checkpoint(tmp_path):
    import signal

    trainer = MetaTrainer(preset("smoke", validate_every=0), out_dir=tmp_path)
    step = trainer.outer_step

    def step_then_terminate(*args, **kwargs):
        out = step(*args, **kwargs)
        if trainer.step == 3:
            signal.raise_signal(signal.SIGTERM)
        return out

    trainer.outer_step = step_then_terminate
    summary = trainer.run(progress=False)
    assert summary["stopped_for"] == "signal" and summary["step"] == 3
    assert torch.load(tmp_path / CHECKPOINT, weights_only=True)["step"] == 3
    assert signal.getsignal(signal.SIGTERM) != trainer._on_signal  # the previous handler is back


def test_throughput_benchmark_writes_its_record(tmp_path, monkeypatch):
    """benchmarks/bench_meta.py (the inner steps/s a GPU run records) on the CPU: one row per family and
    population, each with a positive rate from steps that really ran."""
    import sys

    from benchmarks import bench_meta

    out = tmp_path / "meta.json"
    monkeypatch.setattr(sys, "argv", ["bench_meta.py", "--device", "cpu", "--preset", "smoke", "--populations", "2,4",
                                      "--compile", "off", "--steps", "2", "--warmup", "1", "--out", str(out)])
    assert bench_meta.main() == 0
    record = json.loads(out.read_text())
    families = [spec for spec in preset("smoke").tasks]
    assert [(row["population"], row["compile_inner"]) for row in record["results"]] == [(2, False), (4, False)] * len(families)
    assert all(row["inner_steps_per_second"] > 0 and row["eager_steps"] == 3 for row in record["results"])
    assert record["environment"]["device_type"] == "cpu"


@pytest.mark.usefixtures("single_intra_op_thread")
def test_the_deep_preset_starts_from_the_shipped_weights_and_steps_every_family():
    """The `deep` recipe (shrunk: one pair, truncation 2): θ starts as lopt-small_fc-tiny's network, the five
    families (mulo's three and the two deeper MLPs) take one outer step each, round robin, and θ moves."""
    config = preset("deep", num_tasks=1, truncation=2, validate_every=0, patience=0)
    trainer = MetaTrainer(config)
    start = trainer.space.flatten("lopt-small_fc-tiny")
    assert torch.equal(trainer.theta.detach(), start)
    assert [f.shapes()[0] for f in trainer.families][-2:] == [(64, 40), (128, 64)]
    for _ in range(len(trainer.families)):
        trainer.outer_step()
    assert sorted(g for groups in trainer.history["groups"] for g in groups) == [0, 1, 2, 3, 4]
    assert all(map(math.isfinite, trainer.history["meta_loss"]))
    assert not torch.equal(trainer.theta.detach(), start)
