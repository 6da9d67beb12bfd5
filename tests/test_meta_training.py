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
@pytest.mark.parametrize("estimator, inner_schedule, optimizer, lr_range", [
    ("pes", "constant", "small_fc_lopt", None), ("pes", "cosine", "small_fc_lopt", None),
    ("es", "constant", "small_fc_lopt", None), ("es", "cosine", "small_fc_lopt", None),
    ("pes", "cosine", "celo2", None), ("pes", "constant", "small_fc_lopt", (0.3, 3.0)),
    ("es", "cosine", "small_fc_lopt", (0.3, 3.0))])
def test_checkpoint_resume_is_bit_exact(tmp_path, estimator, inner_schedule, optimizer, lr_range):
    """N outer steps straight == N/2, checkpoint, a new process-like resume from the directory, N/2 more:
    identical θ, AdamW state, PES state (inner parameters, optimizer state, accumulators, positions), with an
    unroll curriculum running across the break; with the inner lr constant and on a cosine over each unroll; for
    CELO2 (its own inner lr, its AdamW branch's moments in the state); with lrs drawn per instance."""
    inner_lr = 0.03 if optimizer == "celo2" else None
    config = preset("smoke", estimator=estimator, outer_steps=12, validate_every=0, min_unroll=10, max_unroll=30,
                    inner_schedule=inner_schedule, optimizer=optimizer, inner_lr=inner_lr, inner_lr_range=lr_range,
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
    assert resumed.config.inner_schedule == inner_schedule
    saved = torch.load(tmp_path / "chunks" / CHECKPOINT, weights_only=True)["config"]
    assert saved.get("inner_schedule", "constant") == inner_schedule
    assert saved.get("inner_lr") == inner_lr and ("inner_lr" in saved) == (inner_lr is not None)
    assert torch.is_tensor(resumed.estimators[0].inner.optimizer.lr) == (inner_schedule == "cosine" or bool(lr_range))
    assert resumed.estimators[0].inner.optimizer.rule.name == optimizer
    assert saved.get("inner_lr_range") == (None if lr_range is None else list(lr_range))
    if lr_range is not None:
        for a_estimator, b_estimator in zip(straight.estimators, resumed.estimators):
            assert torch.equal(a_estimator.inner.lr_base, b_estimator.inner.lr_base)
            assert torch.equal(a_estimator.inner.optimizer.lr, b_estimator.inner.optimizer.lr)


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
    ({"inner_lr": 0.0}, r"inner_lr=0.0: the learned optimizer's lr must be a positive number \(leave it out for"),
    ({"inner_lr": "1e-2"}, r"inner_lr='1e-2': the learned optimizer's lr must be a positive number"),
    ({"inner_lr_range": (1.0, 0.1)}, r"inner_lr_range=\(1.0, 0.1\): give \[low, high\], two positive numbers with low"),
    ({"inner_lr_range": (0.0, 1.0)}, r"inner_lr_range=\(0.0, 1.0\): give \[low, high\]"),
    ({"inner_lr_range": 0.5}, r"inner_lr_range=0.5: give \[low, high\]"),
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

    for name, says in (("velo", "its step (an LSTM"), ("adamw", "is not a registered optimizer")):
        assert main(["meta-train", "--preset", "smoke", "--optimizer", name, "--out", str(tmp_path / name),
                     "--quiet", "--device", "cpu"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("lopt meta-train: error: lopt.meta steps populations of small_fc_lopt, elo, celo2, "
                              "elo_celo2 only")
        assert says in err and not (tmp_path / name).exists()


@pytest.mark.usefixtures("single_intra_op_thread")
def test_celo2_meta_trains_with_its_own_step_and_its_weights_load_into_celo2(tmp_path, capsys):
    """--optimizer celo2 with --set inner_lr=0.03 (CELO2's step has unit RMS per matrix: its lr is its step's
    size): 40 PES outer steps of the smoke preset from random CELO2 weights bring the meta-loss and the
    validation down below AdamW 1e-2's on the same instances (seed 0: meta-loss 1.62 -> 0.46 over the first and
    last 10 steps, validation 1.63 -> 0.44 against AdamW's 0.74; seeds 1-2 end at 0.43-0.59 and 0.44-0.52).
    The weights load into lopt.CELO2, the record says celo2, and meta-eval runs them with CELO2's step."""
    from lopt.cli import main

    out = tmp_path / "celo2"
    assert main(["meta-train", "--preset", "smoke", "--optimizer", "celo2", "--set", "inner_lr=0.03", "--out",
                 str(out), "--quiet", "--device", "cpu"]) == 0
    assert f"lopt.CELO2(weights='{out}')" in capsys.readouterr().out
    record = json.loads((out / RECORD).read_text())
    assert record["config"]["optimizer"] == "celo2" and record["config"]["inner_lr"] == 0.03
    losses = record["history"]["meta_loss"]
    assert statistics.mean(losses[-10:]) < statistics.mean(losses[:10]) - 0.5, losses
    validation = record["history"]["validation"]
    assert validation[-1][1] < validation[0][1] - 0.5, validation
    assert validation[-1][1] < record["history"]["validation_adamw"]["0.01"], record["history"]
    trainer = MetaTrainer.resume(out, "cpu")
    assert trainer.estimators[0].inner.optimizer.lr == 0.03
    celo2 = lopt.CELO2(torch.nn.Linear(4, 3).parameters(), weights=str(out), backend="naive")
    for name, tensor in trainer.space.unflatten(trainer.theta.detach()).items():
        assert torch.equal(celo2.meta_weights.tensors["mlp"][name], tensor), name
    # meta-eval reads the run's optimizer; another is refused with the fix
    assert main(["meta-eval", str(out), "--quick", "--optimizer", "elo_celo2", "--quiet"]) == 2
    assert f"--optimizer elo_celo2: {out} was meta-trained for celo2" in capsys.readouterr().err


def test_registered_weights_name_the_optimizer_they_were_trained_for():
    """meta-eval picks a registered weight set's optimizer: the one whose default weights they are (ELO-CELO2's
    share CELO2's architecture, so the architecture alone would run them with CELO2's AdamW branch)."""
    from lopt.meta.cli import _trained_with

    assert {w: _trained_with(w)[0] for w in ("small_fc_lopt", "lopt-small_fc-tiny", "celo2", "elo-celo2", "elo")} == {
        "small_fc_lopt": "small_fc_lopt", "lopt-small_fc-tiny": "small_fc_lopt", "celo2": "celo2",
        "elo-celo2": "elo_celo2", "elo": "elo"}


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


# ---------------------------------------------------------------------- the inner lr schedule (inner_schedule)

SCHEDULE_FAMILY = {"task": "teacher_student", "in_dim": 5, "out_dim": 3, "teacher_hidden": [8], "student_hidden": [6],
                   "batch_size": 8}
DEFAULT_LR = {"small_fc_lopt": 1.0, "elo": 1e-3}  # lopt.SmallFCLOpt's and lopt.ELO's lr


def _cosine_by_hand(t, length):
    return 0.5 * (1.0 + math.cos(math.pi * t / length))


def _clone(value):
    if torch.is_tensor(value):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    return value


def _record_unrolls(inner, calls):
    """Wrap ``inner.unroll``: for every call, what it started from (state, generator, network, where in the unroll
    each instance is) and what it gave (losses, parameters)."""
    original = inner.unroll

    def recording(network, steps, generator, on_step=None, positions=0, lengths=None):
        call = {"state": _clone(inner.state_dict()), "generator": generator.get_state(), "network": _clone(network),
                "steps": steps, "positions": _clone(positions), "lengths": _clone(lengths)}
        losses = original(network, steps, generator, on_step, positions=positions, lengths=lengths)
        call.update(losses=losses.clone(), params=[p.clone() for p in inner.params])
        calls.append(call)
        return losses

    inner.unroll = recording


def _unroll_by_hand(family, num_tasks, members, call, lr_at, optimizer="small_fc_lopt", make_optimizer=None):
    """``call``'s unroll again, from its state (or, where that is None, from instances drawn anew with its
    generator), by a constant-lr population whose (P,) lr tensor this function writes before every step with
    ``lr_at(t)`` (a list of P numbers)."""
    from lopt.meta.estimators import InnerPopulation

    lr = torch.zeros(num_tasks * members)
    inner = InnerPopulation(family, num_tasks, members, optimizer_kwargs={"optimizer": optimizer, "lr": lr})
    if make_optimizer is not None:
        inner.set_optimizer(make_optimizer(lr))
    assert inner.optimizer.lr is lr
    generator = torch.Generator()
    generator.set_state(call["generator"])
    if call["state"] is None:
        inner.start(generator)
    else:
        inner.load_state_dict(_clone(call["state"]))
    step = [0]

    def write_lr():
        lr.copy_(torch.tensor(lr_at(step[0]), dtype=torch.float32))

    def on_step():
        step[0] += 1
        write_lr()

    write_lr()
    losses = inner.unroll(_clone(call["network"]), call["steps"], generator, on_step)
    return losses, inner.params


@pytest.mark.usefixtures("single_intra_op_thread")
@pytest.mark.parametrize("optimizer", ["small_fc_lopt", "elo"])
@pytest.mark.parametrize("estimator", ["pes", "es"])
def test_scheduled_unrolls_are_constant_lr_unrolls_with_the_lr_set_by_hand(estimator, optimizer):
    """Every unroll of a cosine-scheduled PES (staggered starts, resets) or ES is the same unroll at a constant
    (P,) lr tensor written by hand before every step with the class's lr · ½(1 + cos(π (position + t) / L)), per
    instance (PES: its position in its unroll and its length; ES: t from 0 and the outer step's length), shared by
    both members of the antithetic pair: losses and parameters."""
    from lopt.meta import tasks
    from lopt.meta.estimators import FullES, TruncatedPES
    from lopt.meta.metaparams import MetaParamSpace

    space = MetaParamSpace(lopt.meta.rules.inner_rule(optimizer).architecture)
    theta = space.flatten(lopt.random_weights(space.architecture, seed=3))
    family = tasks.build(SCHEDULE_FAMILY)
    num_tasks, base = 3, DEFAULT_LR[optimizer]
    if estimator == "pes":
        est = TruncatedPES(family, space, num_tasks=num_tasks, truncation=4, min_unroll=8, max_unroll=16,
                           optimizer_kwargs={"optimizer": optimizer}, schedule="cosine")
    else:
        est = FullES(family, space, num_tasks=num_tasks, min_unroll=5, max_unroll=12,
                     optimizer_kwargs={"optimizer": optimizer}, schedule="cosine")
    calls = []
    _record_unrolls(est.inner, calls)
    host, dev = torch.Generator().manual_seed(5), torch.Generator().manual_seed(6)
    est.start(host, dev)
    first_positions = list(est.position) if estimator == "pes" else None
    resets = sum(est.estimate(theta, host, dev)["resets"] for _ in range(5))
    if estimator == "pes":
        assert any(p > 0 for p in first_positions) and resets > 0  # staggered starts, and new unrolls from 0
    for call in calls:
        if estimator == "pes":
            positions, lengths = call["positions"], call["lengths"]
        else:
            assert call["positions"] == 0 and call["lengths"] == call["steps"]
            positions, lengths = [0] * num_tasks, [call["steps"]] * num_tasks

        def lr_at(t):
            per_instance = [base * _cosine_by_hand(p + t, n) for p, n in zip(positions, lengths)]
            return per_instance + per_instance  # rows [+ every instance, − every instance]

        losses, params = _unroll_by_hand(family, num_tasks, 2, call, lr_at, optimizer)
        torch.testing.assert_close(losses, call["losses"], rtol=1e-6, atol=0)
        for a, b in zip(params, call["params"]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    # the lr the last step read: the schedule's value there (well below the class's lr somewhere)
    torch.testing.assert_close(est.inner.optimizer.lr, torch.tensor(lr_at(calls[-1]["steps"] - 1)), rtol=1e-6, atol=0)
    assert float(est.inner.optimizer.lr.min()) < 0.9 * base


@pytest.mark.usefixtures("single_intra_op_thread")
def test_scheduled_validation_follows_the_schedule_over_the_validation_steps():
    """validate() and validate_adamw(lr) under inner_schedule="cosine" are the same runs at a (P,) lr tensor written
    by hand before step t with lr · ½(1 + cos(π t / validation_steps)), for the learned optimizer and for AdamW."""
    from lopt.meta.batched import BatchedAdamW

    steps = 9
    config = preset("smoke", tasks=[SCHEDULE_FAMILY], validation_tasks=3, validation_steps=steps,
                    inner_schedule="cosine", validate_every=0)
    trainer = MetaTrainer(config)
    family = trainer.families[0]
    network = trainer.space.unflatten(trainer.theta.detach())

    def by_hand(base, make_optimizer=None, net=None):
        generator = torch.Generator().manual_seed(777_000)  # the trainer's validation instances (family 0)
        call = {"state": None, "generator": generator.get_state(), "network": net, "steps": steps}
        losses, _ = _unroll_by_hand(family, 3, 1, call, lambda t: [base * _cosine_by_hand(t, steps)] * 3,
                                    make_optimizer=make_optimizer)
        return float(losses.mean())

    assert trainer.validate() == by_hand(1.0, net=network)
    assert trainer.validate_adamw(1e-2) == by_hand(
        1e-2, make_optimizer=lambda lr: BatchedAdamW(family.shapes(), 3, lr=lr))
    constant = MetaTrainer(preset("smoke", tasks=[SCHEDULE_FAMILY], validation_tasks=3, validation_steps=steps))
    assert constant.validate() != trainer.validate() and constant.validate_adamw(1e-2) != trainer.validate_adamw(1e-2)


@pytest.mark.usefixtures("single_intra_op_thread")
def test_the_constant_inner_schedule_is_the_run_as_it_was(tmp_path):
    """inner_schedule="constant" (the default) given or not: the same run bit for bit (meta-losses, validations,
    θ), the learned lr a number as before (no tensor), and no inner_schedule key in the record or checkpoint."""
    runs = []
    for overrides in ({}, {"inner_schedule": "constant"}):
        trainer = MetaTrainer(preset("smoke", outer_steps=6, validate_every=3, validation_steps=15, **overrides),
                              out_dir=tmp_path / str(len(runs)))
        trainer.run(progress=False)
        assert isinstance(trainer.estimators[0].inner.optimizer.lr, float)
        assert "inner_schedule" not in json.loads((tmp_path / str(len(runs)) / RECORD).read_text())["config"]
        runs.append(trainer)
    a, b = runs
    assert a.history["meta_loss"] == b.history["meta_loss"] and a.history["validation"] == b.history["validation"]
    assert a.history["validation_adamw"] == b.history["validation_adamw"]
    assert torch.equal(a.theta.detach(), b.theta.detach())
    cosine = MetaTrainer(preset("smoke", outer_steps=2, validate_every=0, inner_schedule="cosine"))
    cosine.run(progress=False)
    assert cosine.history["meta_loss"] != a.history["meta_loss"][:2]


@pytest.mark.usefixtures("single_intra_op_thread")
def test_scheduled_steps_through_the_emulated_graph_path_are_the_eager_steps_bit_for_bit(monkeypatch):
    """Under inner_schedule="cosine", PES truncations (with resets), ES and validation (learned and AdamW) through
    the emulated CUDA-graph path (whose 'replays' check that no tensor a graph reads, the lr included, is
    replaced) give the eager results bit for bit."""
    from lopt.meta import stepper

    def runs():
        out = []
        for estimator in ("pes", "es"):
            config = preset("smoke", estimator=estimator, tasks=[SCHEDULE_FAMILY], num_tasks=2, truncation=4,
                            min_unroll=8, max_unroll=16, outer_steps=4, validate_every=2, validation_steps=10,
                            inner_schedule="cosine")
            trainer = MetaTrainer(config)
            trainer.run(progress=False)
            inner = trainer.estimators[0].inner
            out.append((trainer.theta.detach().clone(), trainer.history["meta_loss"], trainer.history["validation"],
                        trainer.history["validation_adamw"], [p.clone() for p in inner.params],
                        inner.stepper.graph_steps))
        return out

    eager = runs()
    monkeypatch.setattr(stepper, "EMULATE_ON_CPU", True)
    emulated = runs()
    for a, b in zip(eager, emulated):
        assert torch.equal(a[0], b[0]) and a[1:4] == b[1:4]
        assert all(torch.equal(x, y) for x, y in zip(a[4], b[4]))
        assert a[5] == 0 and b[5] > 0  # eager had no replays; emulated did


def test_inner_schedule_errors_and_records_without_it():
    """An unknown inner_schedule is refused naming the choices; a config saved before the option existed (no
    key) reads as constant."""
    with pytest.raises(ValueError, match=r"inner_schedule='linear': choose one of constant, cosine"):
        MetaTrainer(preset("smoke", inner_schedule="linear"))
    config = preset("smoke").to_dict()
    assert "inner_schedule" not in config
    assert MetaTrainConfig.from_dict(config).inner_schedule == "constant"
    assert MetaTrainConfig.from_dict(preset("smoke", inner_schedule="cosine").to_dict()).inner_schedule == "cosine"
    from lopt.meta.estimators import InnerPopulation
    from lopt.meta import tasks

    inner = InnerPopulation(tasks.build(SCHEDULE_FAMILY), 2, schedule="cosine")
    inner.start(torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"a scheduled unroll \(cosine\) needs the unroll lengths"):
        inner.unroll(None, 2, torch.Generator())
    with pytest.raises(ValueError, match=r"one position and one length per instance \(2\), got 3 and 3"):
        inner.unroll(None, 2, torch.Generator(), positions=[0, 0, 0], lengths=[4, 4, 4])
    with pytest.raises(ValueError, match=r"schedule='linear': choose one of constant, cosine"):
        InnerPopulation(tasks.build(SCHEDULE_FAMILY), 2, schedule="linear")


@pytest.mark.usefixtures("single_intra_op_thread")
def test_meta_train_inner_schedule_option_resumes_and_refuses_another_schedule(tmp_path, capsys):
    """--inner-schedule cosine starts a scheduled run (the record says so) that resumes with the same option or
    none, and is refused with another; a run saved without the key (constant) resumes as constant, and is refused
    with --inner-schedule cosine; --inner-schedule linear is an argparse error."""
    from lopt.cli import main

    common = ["meta-train", "--preset", "smoke", "--quiet", "--device", "cpu", "--set", "validate_every=0"]
    cosine = common + ["--out", str(tmp_path / "cosine")]
    assert main(cosine + ["--inner-schedule", "cosine", "--outer-steps", "2"]) == 0
    assert json.loads((tmp_path / "cosine" / RECORD).read_text())["config"]["inner_schedule"] == "cosine"
    assert main(cosine + ["--inner-schedule", "cosine", "--outer-steps", "3"]) == 2  # (outer_steps differs)
    capsys.readouterr()
    assert main(cosine + ["--inner-schedule", "constant", "--outer-steps", "2"]) == 2
    assert "other settings (inner_schedule)" in capsys.readouterr().err
    assert MetaTrainer.resume(tmp_path / "cosine").config.inner_schedule == "cosine"

    constant = common + ["--out", str(tmp_path / "constant"), "--outer-steps", "2"]
    assert main(constant) == 0
    assert "inner_schedule" not in torch.load(tmp_path / "constant" / CHECKPOINT, weights_only=True)["config"]
    assert main(constant + ["--inner-schedule", "cosine"]) == 2
    assert "other settings (inner_schedule)" in capsys.readouterr().err
    assert main(constant + ["--set", "inner_schedule=cosine"]) == 2
    assert "other settings (inner_schedule)" in capsys.readouterr().err
    assert main(constant) == 0 and "outer step 2/2, finished" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(common + ["--out", str(tmp_path / "x"), "--inner-schedule", "linear"])
    assert "invalid choice: 'linear'" in capsys.readouterr().err


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_an_lr_range_draws_one_lr_per_instance_shared_by_its_pair_and_redraws_on_reset(schedule):
    """inner_lr_range: every instance's learned lr is log-uniform in the range, both members of its antithetic pair
    share it, a reset redraws exactly the reset instances', and the optimizer reads them from one tensor written in
    place (a captured graph's); without a schedule the optimizer's lr is the drawn lr itself, with one the unroll
    scales it (checked against the multipliers); validation populations keep the fixed lr."""
    from lopt.meta import tasks as tasks_lib
    from lopt.meta.estimators import InnerPopulation
    from lopt.meta.metaparams import MetaParamSpace
    from lopt.meta.schedules import SCHEDULES

    family = tasks_lib.build({"task": "logreg", "dim": 4, "classes": 3, "separation": 3.0, "batch_size": 8})
    inner = InnerPopulation(family, 6, 2, "cpu", {"optimizer": "small_fc_lopt"}, schedule=schedule,
                            lr_range=(0.1, 10.0))
    generator = torch.Generator().manual_seed(0)
    inner.start(generator)
    lrs, tensor = inner.lr_base.clone(), inner.optimizer.lr
    assert lrs.shape == (12,) and torch.equal(lrs[:6], lrs[6:])  # [+ for every instance, − for every instance]
    assert bool(((lrs >= 0.1) & (lrs <= 10.0)).all()) and len(set(lrs[:6].tolist())) == 6
    assert float(lrs.log().std()) > 0.5  # spread over the two decades, not bunched
    if schedule == "constant":
        assert torch.equal(tensor, lrs)
    network = MetaParamSpace("small_fc_lopt").unflatten(
        MetaParamSpace("small_fc_lopt").flatten(lopt.random_weights("small_fc_lopt", seed=0)))
    inner.unroll(network, 3, generator, positions=[1] * 6, lengths=[10] * 6)
    assert inner.optimizer.lr is tensor  # written in place, never replaced
    if schedule == "cosine":  # the last step's lr: the drawn lr times the schedule at position 1 + 2 of 10
        assert torch.allclose(tensor, lrs * SCHEDULES["cosine"](3, 10), rtol=1e-6)
    mask = torch.tensor([True, False, False, True, False, False])
    inner.reset(mask, generator)
    again = inner.lr_base
    changed = (again != lrs).view(2, 6)
    assert changed[0].tolist() == mask.tolist() and changed[1].tolist() == mask.tolist()
    assert torch.equal(again[:6], again[6:])
    validator = InnerPopulation(family, 2, 1, "cpu", {"optimizer": "small_fc_lopt"}, schedule=schedule)
    validator.start(generator)
    assert validator.lr_range is None and (validator.lr_base is None) == (schedule == "constant")
