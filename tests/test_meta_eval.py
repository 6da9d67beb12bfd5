"""lopt meta-eval: the quick suite end to end, and one evaluation run against SmallFCLOpt (ELO) on torch.nn modules."""

import json
import warnings

import pytest
import torch

import lopt
from lopt.cli import main
from lopt.meta import evaluate, tasks

pytest.importorskip("sklearn", reason="the held-out suite uses scikit-learn's bundled data sets (lopt[meta])")


@pytest.mark.usefixtures("single_intra_op_thread")
@pytest.mark.parametrize("optimizer", ["small_fc_lopt", "elo"])
def test_an_evaluation_run_is_the_optimizer_training_torch_nn_modules(optimizer):
    """The learned optimizer's population run (seed 1 of the wine MLP) trains exactly as SmallFCLOpt (ELO)
    trains torch.nn.Linear layers holding the same initial values on the same batches."""
    from lopt.meta.batched import BatchedSmallFCLOpt, inner_rule

    rule = inner_rule(optimizer)
    family = tasks.build({"task": "mlp", "dataset": "wine", "hidden": [16], "batch_size": 16})
    weights = lopt.random_weights(rule.architecture, seed=5)

    opt = BatchedSmallFCLOpt(family.shapes(), 2, optimizer=optimizer)
    opt.network = weights.tensors["mlp"]
    steps = 12
    out = evaluate.train_population(family, opt, [1, 1], steps, "cpu")
    assert torch.equal(out["train"][:, 0], out["train"][:, 1])

    generator = evaluate._seed_generator("cpu", 1)
    inst = family.sample_instances(1, generator)
    init = family.init_params(1, inst, generator)
    model = torch.nn.Sequential(torch.nn.Linear(13, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    with torch.no_grad():
        for p, value in zip(model.parameters(), init):
            p.copy_(value[0])
    reference = rule.front_end(model.parameters(), weights=weights, backend="naive")
    for t in range(steps):
        x, y = family.sample_batch(inst, generator)
        loss = torch.nn.functional.cross_entropy(model(x[0]), y[0])
        loss_value = loss.detach()
        assert abs(loss_value.item() - float(out["train"][t, 0])) <= 1e-5 * loss_value.item(), t
        reference.zero_grad()
        loss.backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            reference.step()
    for p, got in zip(model.parameters(), out["params"]):
        assert float((got[0] - p.detach()).norm() / p.detach().norm()) <= 1e-5


@pytest.mark.usefixtures("single_intra_op_thread")
def test_quick_meta_eval_writes_table_json_plot_and_resumes(tmp_path, capsys):
    out = tmp_path / "eval"
    assert main(["meta-eval", "random", "--quick", "--out", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "| task | horizon | optimizer |" in printed
    report = json.loads((out / "results.json").read_text())
    assert report["complete"] and report["settings"]["quick"]
    names = [t["task"] for t in report["tasks"]]
    assert names == [t.name for t in evaluate.SUITES["heldout-v1"]]
    for task in report["tasks"]:
        assert set(task["summary"]) == {"learned", "adamw_tuned", "adamw_default"}
        assert task["tuned_lr"] in evaluate.QUICK["lrs"]
        for summary in task["summary"].values():
            assert len(summary["runs"]) == len(evaluate.QUICK["report_seeds"])
            assert 0.0 <= summary["divergence_rate"] <= 1.0
    assert (out / "results.md").read_text().count("\n") >= 2 + 3 * len(names)
    assert (out / "curves.png").stat().st_size > 1000
    # a rerun finds every run done and reproduces the report
    before = (out / "results.md").read_text()
    assert main(["meta-eval", "random", "--quick", "--out", str(out), "--quiet"]) == 0
    assert (out / "results.md").read_text() == before


def test_exported_data_sets_stand_in_for_scikit_learn(tmp_path, monkeypatch):
    """`python -m lopt.meta.data export FILE` + LOPT_META_DATA=FILE: the same data sets where scikit-learn is
    missing (an offline GPU machine); without either, a clear MissingDependency."""
    import sys

    from lopt.meta import data

    path = data.export(tmp_path / "meta_data.pt")
    expected = data.digits()
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)  # import fails as if not installed
    with pytest.raises(data.MissingDependency, match="LOPT_META_DATA"):
        data.wine()
    monkeypatch.setenv("LOPT_META_DATA", str(path))
    got = data.digits()
    assert torch.equal(got.train_x, expected.train_x) and torch.equal(got.test_y, expected.test_y)
    assert data.breast_cancer().num_classes == 2
