"""lopt bench: its outputs (JSON, Markdown, plots, curves), its modes and the pieces they are made of.

The runs are tiny (toy-lm: 3 tensors; tiny-lm under transformers) and take a few steps, so the
whole file stays within CI's budget on 2 cores; the one cold torch.compile dominates it.
"""

import csv
import json
import math
import statistics
import sys
import time

import pytest
import torch

import lopt
from lopt import registry
from lopt import cli
from lopt.bench import contenders, curves, measure, report, runner
from lopt.bench.models import build_model, markov_token_stream
from lopt.param_sets import MODELS, param_set_shapes

RESULT_KEYS = {"optimizer", "backend", "contender", "param_set", "mode", "ms_per_step", "ms_all", "launches_per_step",
               "peak_extra_mib", "max_rel_error_vs_naive", "overhead_vs_adamw", "compile_s", "gmacs_per_s", "note",
               "host_ms_per_step"}
ENVIRONMENT_KEYS = {"date", "lopt", "torch", "torch_cuda", "python", "device_type", "device", "cpu_threads", "cupy",
                    "commit"}


def run_cli(*argv):
    return cli.main([str(a) for a in argv])


def distinct_colours(path) -> int:
    from PIL import Image

    with Image.open(path) as image:
        assert image.format == "PNG"
        width, height = image.size
        assert width >= 400 and height >= 300
        return len(image.convert("RGB").getcolors(maxcolors=1 << 20))


# ---------------------------------------------------------------------------------------- one full CPU run


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """Step mode with every contender, the plot, Markdown, JSON, and loss curves (naive vs naive+compile)."""
    directory = tmp_path_factory.mktemp("bench")
    lopt.random_weights("small_fc_lopt", seed=4).save(directory / "weights")
    paths = {name: directory / name for name in ("run.json", "run.md", "times.png", "curves.png")}
    import io
    from contextlib import redirect_stdout

    stdout = io.StringIO()
    with redirect_stdout(stdout):
        code = run_cli("bench", "--device", "cpu", "--optimizer", "small_fc_lopt", "--params", "toy-lm",
                       "--backends", "adamw,naive,naive+compile,fused", "--steps", "3", "--warmup", "0", "--quiet",
                       "--weights", directory / "weights", "--json", paths["run.json"], "--markdown", paths["run.md"],
                       "--plot", paths["times.png"], "--curves", paths["curves.png"], "--curves-model", "toy-lm",
                       "--curves-steps", "5", "--curves-lr", "0.05", "--curves-weight-decay", "0.01")
    return code, stdout.getvalue(), paths, json.loads(paths["run.json"].read_text()) if code == 0 else None


def test_full_run_exits_0_and_writes_every_file(full_run):
    code, out, paths, _ = full_run
    assert code == 0, out
    for path in paths.values():
        assert f"wrote {path}" in out and path.stat().st_size > 0


def test_json_schema_and_values(full_run):
    _, _, _, record = full_run
    assert record["schema_version"] == 2 and record["mode"] == "step"
    assert ENVIRONMENT_KEYS <= set(record["environment"]) and record["environment"]["torch"] == torch.__version__
    assert record["settings"]["steps"] == 3 and record["settings"]["same_grads"] is False
    assert record["settings"]["cooldown_ms"] == 0.0
    assert record["weights"]["small_fc_lopt"]["pretrained"] is True
    rows = {r["contender"]: r for r in record["results"]}
    assert list(rows) == ["adamw", "naive", "naive+compile"], record["unavailable"]  # e.g. failed under torch.compile
    for row in record["results"]:
        assert set(row) == RESULT_KEYS and row["mode"] == "step" and row["param_set"] == "toy-lm"
        assert len(row["ms_all"]) == 3 and all(t > 0 for t in row["ms_all"])
        assert row["ms_per_step"] == sorted(row["ms_all"])[1]  # the median of 3
        assert row["launches_per_step"] is None and row["peak_extra_mib"] is None  # CPU: not measured
        expected = 100 * (row["ms_per_step"] / rows["adamw"]["ms_per_step"] - 1)
        assert row["overhead_vs_adamw"] == pytest.approx(expected, rel=1e-12, abs=1e-12)
    assert rows["adamw"]["optimizer"] == "adamw" and rows["adamw"]["backend"] == "foreach"
    assert rows["naive"]["optimizer"] == "small_fc_lopt" and rows["naive"]["max_rel_error_vs_naive"] is None
    compiled = rows["naive+compile"]
    assert compiled["compile_s"] > 0 and rows["naive"]["compile_s"] is None
    # The compiled step computes the naive step's math (rounding may differ): first steps agree closely.
    assert 0 <= compiled["max_rel_error_vs_naive"] < 1e-5
    numel = sum(math.prod(s) for _, s in param_set_shapes("toy-lm"))
    assert compiled["gmacs_per_s"] == pytest.approx(measure.MLP_MACS_PER_ELEMENT["small_fc_lopt"] * numel
                                                    / (compiled["ms_per_step"] * 1e-3) / 1e9)
    fused = [u for u in record["unavailable"] if u["contender"] == "fused"]
    assert len(fused) == 1 and fused[0]["optimizer"] == "small_fc_lopt" and fused[0]["reason"]
    if not torch.cuda.is_available():
        assert fused[0]["reason"] == "no CUDA device is available to PyTorch"


def test_console_and_markdown_tables(full_run):
    _, out, paths, record = full_run
    markdown = paths["run.md"].read_text()
    assert markdown.startswith("# lopt bench (step mode)\n")
    assert ("| optimizer | contender | params | ms/step (median) | min-max | vs adamw | launches | peak MiB | "
            "rel.err vs naive | compile s |") in markdown
    compiled = next(r for r in record["results"] if r["contender"] == "naive+compile")
    spread = f"{min(compiled['ms_all']):.2f}-{max(compiled['ms_all']):.2f}"  # the timed steps' range, beside the median
    assert (f"| small_fc_lopt | naive+compile | toy-lm | {compiled['ms_per_step']:.2f} | {spread} | "
            f"{compiled['overhead_vs_adamw']:+.0f}% | - | - | {compiled['max_rel_error_vs_naive']:.2e} | "
            f"{compiled['compile_s']:.1f} |") in markdown
    # no fused row (a CPU): what naive's time means is said, in the console and the Markdown
    assert "Note: " + report.NAIVE_NOTE in markdown
    assert "Note: naive is lopt's readable reference backend" in out and "Training speed is the fused" in out
    assert "| small_fc_lopt | fused | toy-lm | not run [1] |" in markdown
    assert "## Loss curves" in markdown
    table = out[out.index("optimizer  "):]
    assert "small_fc_lopt  fused            toy-lm  not run [1]" in table
    assert "\n[1] " in table


def test_times_plot_is_a_real_picture(full_run):
    _, _, paths, _ = full_run
    assert distinct_colours(paths["times.png"]) > 20


def test_curves_record_and_plot(full_run):
    _, out, paths, record = full_run
    curve = record["curves"]
    assert curve["model"] == "toy-lm" and curve["steps"] == 5 and curve["contender"] == "naive+compile"
    assert curve["why"].startswith("no fused backend without CUDA")
    assert curve["nudge"] == {"relative": curves.NUDGE_RELATIVE, "seed": curves.NUDGE_SEED}
    assert curve["options"] == {"lr": 0.05, "weight_decay": 0.01}
    runs = curve["optimizers"]["small_fc_lopt"]
    assert list(runs["losses"]) == ["naive", "naive+compile", curves.NUDGED_RUN]
    naive = runs["losses"]["naive"]
    for label, losses in runs["losses"].items():
        assert len(losses) == 5 and all(math.isfinite(v) for v in losses)
        # Same initialisation and batch: the first loss is computed before any update, so it is identical.
        assert losses[0] == naive[0]
        if label != "naive":
            expected = max(abs(a - b) / abs(b) for a, b in zip(losses, naive))
            assert runs["max_rel_diff_vs_naive"][label] == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert math.log(256) - 0.5 < naive[0] < math.log(256) + 0.5  # an untrained 256-token model
    assert "loss curves: toy-lm" in out and "small_fc_lopt: largest relative loss difference vs naive" in out
    assert "5 steps, lr 0.05, weight_decay 0.01, contender naive+compile" in out
    assert distinct_colours(paths["curves.png"]) > 20


@pytest.mark.parametrize("contender", ["naive", "naive+compile"])
def test_curves_options_become_the_learned_optimizers_hyperparameters(contender):
    """What --curves-lr / --curves-weight-decay hand to every learned run (loss_curves' ``options``)."""
    params = [torch.nn.Parameter(torch.randn(3, 2))]
    built = contenders.make_contender("small_fc_lopt", contender, params, lopt.random_weights("small_fc_lopt", seed=1),
                                      torch.device("cpu"), options={"lr": 0.05, "weight_decay": 0.01})
    group = built.optimizer.param_groups[0]
    assert (group["lr"], group["weight_decay"]) == (0.05, 0.01)


# ---------------------------------------------------------------------------------------- iteration mode


def test_iteration_mode_on_a_tiny_transformers_gpt2(capsys, tmp_path, offline_hub):
    pytest.importorskip("transformers")
    out_json = tmp_path / "iteration.json"
    code = run_cli("bench", "--device", "cpu", "--mode", "iteration", "--params", "tiny-lm", "--backends",
                   "adamw,naive", "--steps", "2", "--warmup", "0", "--batch-size", "2", "--seq-len", "16", "--quiet",
                   "--json", out_json)
    out = capsys.readouterr().out
    assert code == 0, out
    assert "iteration mode on cpu" in out and "time per training iteration (zero_grad + forward + backward + step)" in out
    record = json.loads(out_json.read_text())
    assert record["mode"] == "iteration" and record["settings"]["batch_size"] == 2 and record["settings"]["seq_len"] == 16
    rows = [(r["optimizer"], r["contender"]) for r in record["results"]]
    # (the report's order: AdamW first, then the optimizers by name)
    assert rows == [("adamw", "adamw")] + [(name, "naive") for name in sorted(registry.names())]
    adamw = record["results"][0]["ms_per_step"]
    for r in record["results"]:
        assert r["mode"] == "iteration" and len(r["ms_all"]) == 2 and r["ms_per_step"] > 0
        assert r["overhead_vs_adamw"] == pytest.approx(100 * (r["ms_per_step"] / adamw - 1))
    reasons = {(u["optimizer"], u["contender"]): u["reason"] for u in record["unavailable"]}
    assert set(reasons) == {(o, c) for o in registry.names() for c in ("naive+compile", "fused", "fused-fast")}


def test_iteration_workload_trains_with_fresh_gradients():
    """One timed iteration is zero_grad + forward + backward + step: new .grad tensors, parameters move."""
    pytest.importorskip("transformers")
    model = build_model("tiny-lm", "cpu", batch_size=2, seq_len=8)
    params = model.parameters()
    assert [(tuple(p.shape)) for p in params] == [shape for _, shape in param_set_shapes("tiny-lm")]
    contender = contenders.make_contender("small_fc_lopt", "naive", params, lopt.random_weights("small_fc_lopt"),
                                          torch.device("cpu"))
    workload = measure.IterationWorkload(model, model.random_batch(), torch.device("cpu"))
    workload.contender = contender
    before = [p.detach().clone() for p in params]
    workload.timed(0)
    first_grads = [p.grad for p in params]
    workload.timed(1)
    assert all(g is not None for g in first_grads)
    assert all(p.grad is not g for p, g in zip(params, first_grads))
    assert all(not torch.equal(p.detach(), b) for p, b in zip(params, before))
    assert contender.optimizer.param_groups[0]["step"] == 2


def test_iteration_mode_checks_a_contender_against_naive_on_real_gradients():
    """The first-step check in iteration mode: a naive step under the name of a checked contender differs by 0."""
    model = build_model("toy-lm", "cpu", batch_size=4, seq_len=12)
    params = model.parameters()
    weights = lopt.random_weights("velo", seed=3)
    optimizer = contenders.make_learned_optimizer("velo", params, "naive", weights, num_steps=50)
    disguised = contenders.Contender("velo", "fused", "fused", optimizer, contenders.step_function(optimizer))
    workload = measure.IterationWorkload(model, model.random_batch(), torch.device("cpu"))
    result = measure.measure_contender(workload, disguised, weights=weights, param_set="toy-lm", mode="iteration",
                                       steps=2, warmup=0, baseline_bytes=None, num_steps=50)
    assert result.max_rel_error_vs_naive == 0.0 and len(result.ms_all) == 2 and result.mode == "iteration"
    assert optimizer.param_groups[0]["step"] == 3  # the checked first step, then two timed iterations


# ---------------------------------------------------------------------------------------- step mode pieces


class RecordingStep:
    """Wraps a contender's step and records the .grad objects each step saw."""

    def __init__(self, params, step):
        self.params, self.step, self.seen = params, step, []

    def __call__(self, loss):
        self.seen.append([p.grad for p in self.params])
        self.step(loss)


@pytest.mark.parametrize("same_grads", [False, True])
def test_step_mode_assigns_new_gradient_tensors_every_step(same_grads):
    params = [torch.nn.Parameter(torch.randn(6, 5)), torch.nn.Parameter(torch.randn(5))]
    sets = measure.gradient_sets(params, 1 if same_grads else measure.GRADIENT_SETS)
    workload = measure.StepWorkload(params, sets, torch.device("cpu"))
    contender = contenders.make_contender("small_fc_lopt", "naive", params, lopt.random_weights("small_fc_lopt"),
                                          torch.device("cpu"))
    recorder = RecordingStep(params, contender.step)
    contender.step = recorder
    result = measure.measure_contender(workload, contender, weights=None, param_set="test", mode="step", steps=4, warmup=1,
                             baseline_bytes=None, num_steps=10)
    assert len(result.ms_all) == 4 and len(recorder.seen) == 5  # 1 warm-up + 4 timed (no launch count on a CPU)
    # (on a CPU the host's time to issue a step is the step's wall time)
    assert result.host_ms_per_step == round(statistics.median(result.ms_all), 4) > 0
    for previous, current in zip(recorder.seen, recorder.seen[1:]):
        if same_grads:
            assert all(a is b for a, b in zip(previous, current))
        else:
            assert all(a is not b for a, b in zip(previous, current))
            assert not any(torch.equal(a, b) for a, b in zip(previous, current))
    for grads in sets:  # N(0, 1e-3²) gradients of each parameter's shape
        assert [g.shape for g in grads] == [p.shape for p in params]
        assert 0.5e-3 < torch.cat([g.flatten() for g in grads]).std() < 2e-3


def test_cooldown_idles_before_every_timed_step_and_only_then(monkeypatch):
    """--cooldown-ms: the device idles that long before each timed step (outside the timed region), not
    before warm-up steps; 0 (the default) never waits."""
    params = [torch.nn.Parameter(torch.randn(6, 5))]
    real_idle = measure.idle
    for cooldown, expected in ((0.0, []), (25.0, [25.0] * 3)):
        workload = measure.StepWorkload(params, measure.gradient_sets(params, 1), torch.device("cpu"))
        contender = contenders.make_contender("adamw", "adamw", params, None, torch.device("cpu"))
        waited = []
        monkeypatch.setattr(measure, "idle", lambda ms: (waited.append(ms), real_idle(ms)))
        result = measure.measure_contender(workload, contender, weights=None, param_set="test", mode="step", steps=3,
                                           warmup=2, baseline_bytes=None, num_steps=10, cooldown_ms=cooldown)
        assert len(result.ms_all) == 3 and waited == expected
        assert max(result.ms_all) < 25  # (the idle time is outside the timed region)


def test_idle_waits_without_sleeping(monkeypatch):
    monkeypatch.setattr(measure.time, "sleep", lambda seconds: pytest.fail("idle slept"))
    begin = time.perf_counter()
    measure.idle(30.0)
    assert 0.030 <= time.perf_counter() - begin < 0.5


def test_cooldown_must_be_a_non_negative_number(capsys):
    for bad in ("-5", "nan", "soon"):
        with pytest.raises(SystemExit):
            run_cli("bench", "--device", "cpu", "--cooldown-ms", bad)
        assert "--cooldown-ms: must be a number of milliseconds >= 0" in capsys.readouterr().err


def test_relative_update_error_against_float64():
    generator = torch.Generator().manual_seed(3)
    before = [torch.randn(4, 3, generator=generator), torch.randn(7, generator=generator)]
    reference = [b + 1e-3 * torch.randn(b.shape, generator=generator) for b in before]
    after = [r + 1e-9 * torch.randn(r.shape, generator=generator) for r in reference]
    expected = max(((a.double() - b.double()) - (r.double() - b.double())).norm().item()
                   / (r.double() - b.double()).norm().item() for a, b, r in zip(after, before, reference))
    assert measure.relative_update_error(after, before, reference) == pytest.approx(expected, rel=1e-12)
    assert measure.relative_update_error(reference, before, reference) == 0.0


def test_first_step_check_of_a_contender_that_is_naive_itself():
    """The check's naive step runs on copies from identical state: a naive contender differs by exactly 0."""
    params = [torch.nn.Parameter(torch.randn(8, 6)), torch.nn.Parameter(torch.randn(6))]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    weights = lopt.random_weights("velo", seed=1)
    contender = contenders.make_contender("velo", "naive", params, weights, torch.device("cpu"), num_steps=100)
    before = [p.detach().clone() for p in params]
    error, seconds = measure.first_step_vs_naive(contender, params, weights, torch.tensor(3.0), num_steps=100)
    assert error == 0.0 and seconds > 0
    assert all(not torch.equal(p.detach(), b) for p, b in zip(params, before))  # the contender's step happened


def test_compile_failure_is_reported_and_the_rest_runs(monkeypatch):
    def broken_compile(*args, **kwargs):
        raise RuntimeError("no C++ compiler here\nsecond line")

    monkeypatch.setattr(torch, "compile", broken_compile)
    weights = {"small_fc_lopt": lopt.random_weights("small_fc_lopt")}
    plan = runner.BenchPlan(mode="step", optimizers=["small_fc_lopt"], param_sets=["toy-lm"],
                            contenders=["naive", "naive+compile"], device=torch.device("cpu"), weights=weights,
                            steps=1, warmup=0, show_progress=False)
    plan.availability = runner.probe_availability(plan)
    said = []
    results, unavailable = runner.run_benchmarks(plan, say=said.append)
    assert [(r.optimizer, r.contender) for r in results] == [("small_fc_lopt", "naive")]
    compiled = next(u for u in unavailable if u.contender == "naive+compile")
    assert compiled.reason == "failed under torch.compile: RuntimeError: no C++ compiler here"
    assert said == ["small_fc_lopt naive+compile toy-lm: failed under torch.compile: RuntimeError: no C++ compiler here"]


def test_fused_availability_is_asked_of_the_optimizer(monkeypatch):
    weights = lopt.random_weights("small_fc_lopt")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert contenders.fused_unavailable_reason("small_fc_lopt", weights, torch.device("cpu")) == \
        "no CUDA device is available to PyTorch"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert "--device cpu" in contenders.fused_unavailable_reason("small_fc_lopt", weights, torch.device("cpu"))
    # The reason is the constructor's own message, without its "X(backend='fused') cannot run:" preamble.
    try:
        lopt.SmallFCLOpt([torch.nn.Parameter(torch.randn(3))], weights=weights, backend="fused")
    except RuntimeError as err:
        message = str(err)
    assert message.startswith("SmallFCLOpt(backend='fused') cannot run: ")
    assert contenders.short_reason(RuntimeError(message)) == message[len("SmallFCLOpt(backend='fused') cannot run: "):]


@pytest.mark.parametrize("requested,expected", [(["adamw", "naive"], {"naive+compile": contenders.NOT_SELECTED_COMPILE,
                                                                      "fused": "not selected (--backends)",
                                                                      "fused-fast": contenders.NOT_SELECTED_FAST})])
def test_availability_names_every_contender(requested, expected):
    reasons = contenders.availability("small_fc_lopt", requested, lopt.random_weights("small_fc_lopt"),
                                      torch.device("cpu"))
    assert reasons == {"naive": None, **expected}


def test_fused_fast_is_small_fc_lopts_alone():
    """precision='fast' exists for small_fc_lopt only: VeLO's reason says so before any device question."""
    velo = contenders.availability("velo", ["fused-fast"], lopt.random_weights("velo"), torch.device("cpu"))
    assert velo["fused-fast"] == "VeLO has no precision option"
    weights = lopt.random_weights("small_fc_lopt")
    small_fc = contenders.availability("small_fc_lopt", ["fused-fast"], weights, torch.device("cpu"))
    assert small_fc["fused-fast"] == contenders.fused_unavailable_reason("small_fc_lopt", weights, torch.device("cpu"))


def test_overheads_against_the_adamw_row_of_the_same_set():
    rows = [measure.BenchResult("adamw", "fused", "a", 2.0, contender="adamw"),
            measure.BenchResult("small_fc_lopt", "fused", "a", 7.0, contender="fused"),
            measure.BenchResult("adamw", "fused", "b", 4.0, contender="adamw"),
            measure.BenchResult("velo", "naive", "b", 3.0, contender="naive"),
            measure.BenchResult("velo", "naive", "c", 3.0, contender="naive")]
    runner.add_overheads(rows)
    assert [r.overhead_vs_adamw for r in rows] == [0.0, 250.0, 0.0, -25.0, None]


def test_json_writes_non_finite_numbers_as_null():
    row = measure.BenchResult("small_fc_lopt", "naive", "toy-lm", float("nan"), [float("inf"), 1.0], contender="naive")
    text = report.results_json([row], [], mode="step", env={"device": "x"}, settings={}, weights={}, curves=None)
    record = json.loads(text)
    assert record["results"][0]["ms_per_step"] is None and record["results"][0]["ms_all"] == [None, 1.0]


def test_legacy_building_blocks_for_the_gpu_scripts():
    """benchmarks/bench_small_fc_lopt.py uses these: bench_one (fresh gradients), count_launches, format_table."""
    from lopt import bench

    weights = lopt.random_weights("small_fc_lopt")
    row = bench.bench_one("small_fc_lopt", "naive", "toy-lm", weights, device=torch.device("cpu"), steps=2, warmup=0)
    assert row.contender == "naive" and len(row.ms_all) == 2 and row.gmacs_per_s > 0
    params = [torch.nn.Parameter(torch.randn(3, 2))]
    params[0].grad = torch.randn(3, 2)
    optimizer = bench.make_optimizer("adamw", params, "foreach", None)
    assert bench.count_launches(optimizer, torch.device("cpu")) is None
    assert len(bench.time_steps(optimizer, 3, 1, torch.device("cpu"))) == 3
    # Rows built positionally, as the scripts build them (no contender; variant backends), print too.
    variant = bench.BenchResult("small_fc_lopt", "fused[SFC_X=1]", "toy-lm", 5.0, [5.0], 6, 12.0)
    adamw = bench.BenchResult("adamw", "fused", "toy-lm", 1.0, [1.0])
    lines = bench.format_table([variant, row, adamw]).splitlines()
    assert [line.split()[:3] for line in lines[2:]] == [["adamw", "adamw", "(fused)"], ["small_fc_lopt", "naive", "toy-lm"],
                                                       ["small_fc_lopt", "fused[SFC_X=1]", "toy-lm"]]


def test_ncu_summary_sums_per_opcode_and_lists_the_most_stalled_instructions(tmp_path, capsys):
    """benchmarks/ncu_by_opcode.py on a source-page CSV as Nsight Compute writes it (a preamble, quoted
    fields): per-opcode sums over predicated and plain instructions, and --top's offsets and shares."""
    from benchmarks import ncu_by_opcode

    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
              "L1 Wavefronts Shared", "L1 Tag Requests Global", "stall_long_sb", "stall_wait"]
    rows = [["0x7f00", "LDG.E R3, desc[UR4][R2.64]", "10", "64", "0", "32", "0", "10"],
            ["0x7f10", "@P0   FMUL R3, R13, R3", "60", "64", "0", "0", "58", "2"],
            ["0x7f20", "FMUL R4, R3, R3", "30", "64", "0", "0", "0", "30"]]
    path = tmp_path / "sass.csv"
    with open(path, "w", newline="") as f:
        f.write("==PROF== Disconnected from process 1\n\"Kernel Name\",\"k\",\n")
        csv.writer(f, quoting=csv.QUOTE_ALL).writerows([header, *rows])
    per_opcode, totals = ncu_by_opcode.by_opcode(str(path))
    assert per_opcode["FMUL"]["Instructions Executed"] == 128 and per_opcode["FMUL"]["stall_long_sb"] == 58
    assert totals["Warp Stall Sampling (All Samples)"] == 100 and totals["L1 Tag Requests Global"] == 32
    ncu_by_opcode.print_top_stalls(str(path), 2, units=32)
    lines = capsys.readouterr().out.strip().splitlines()[1:]
    assert lines[0].startswith("0x00010  60.00% (long_sb 58.0%, wait 2.0%) x2.00") and lines[0].endswith("@P0   FMUL R3, R13, R3")
    assert lines[1].startswith("0x00020  30.00% (wait 30.0%")


# ---------------------------------------------------------------------------------------- curves pieces


def test_nudged_weights_change_each_tensor_by_about_1e_7():
    weights = lopt.random_weights("small_fc_lopt", seed=5)
    nudged = curves.nudged_weights(weights)
    again = curves.nudged_weights(weights)
    assert nudged.architecture == weights.architecture and nudged.pretrained == weights.pretrained
    for component, tensors in weights.tensors.items():
        for name, tensor in tensors.items():
            moved = nudged.tensors[component][name]
            assert moved.dtype == torch.float32 and torch.equal(moved, again.tensors[component][name])
            ratio = moved.double() / tensor.double() - 1
            nonzero = tensor != 0
            assert ratio[nonzero].abs().max() < 1e-6  # 1e-7·N(0,1), rounded to float32
            if tensor.numel() > 100:
                assert 0.3e-7 < ratio[nonzero].std() < 3e-7
                assert (ratio != 0).float().mean() > 0.5


def test_max_relative_difference():
    losses, reference = [2.0, 1.5, 1.2], [2.0, 1.6, 1.0]
    assert curves.max_relative_difference(losses, reference) == pytest.approx(0.2)
    assert curves.max_relative_difference([2.0, float("nan")], [2.0, 1.0]) is None
    assert curves.describe_difference(0.0052) == "0.52%" and curves.describe_difference(None) == "not finite"


def test_markov_token_stream_is_fixed_and_sparse():
    stream = markov_token_stream(50, rows=40, seq_len=30, seed=1)
    assert stream.shape == (40, 30) and torch.equal(stream, markov_token_stream(50, rows=40, seq_len=30, seed=1))
    assert int(stream.min()) >= 0 and int(stream.max()) < 50
    successors = {}
    for row in stream.tolist():
        for a, b in zip(row, row[1:]):
            successors.setdefault(a, set()).add(b)
    assert max(len(s) for s in successors.values()) <= 4  # each token has at most 4 successors


def test_curves_contender_defaults():
    assert curves.curves_contender(torch.device("cpu"), None)[0] == "naive+compile"
    assert curves.curves_contender(torch.device("cuda"), None) == ("fused", "the fused backend on CUDA")
    assert curves.curves_contender(torch.device("cpu"), "fused") == ("fused", "chosen with --curves-contender")


# ---------------------------------------------------------------------------------------- models


@pytest.mark.parametrize("name", ["gpt2-small", "gpt2-medium", "tiny-lm", "gpt2-1x64", "gpt2-4x256"])
def test_gpt2_parameter_sets_match_transformers(name):
    """Step mode's shapes are exactly the parameters of the model iteration mode builds (meta device: no memory)."""
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(**MODELS[name].config))
    assert [(n, tuple(p.shape)) for n, p in model.named_parameters()] == param_set_shapes(name)


@pytest.mark.parametrize("name", ["vit-b16", "resnet50"])
def test_image_parameter_sets_match_timm(name):
    """Step mode's shapes are exactly the parameters of the timm model iteration mode builds (ResNet-50's conv
    kernels: CELO2's sliced tensors)."""
    try:
        import timm
    except Exception as err:  # CPU CI: timm needs a torchvision that matches torch
        pytest.skip(f"timm cannot be imported here: {err}")
    with torch.device("meta"):
        model = timm.create_model(MODELS[name].config["timm_name"], pretrained=False)
    assert [(n, tuple(p.shape)) for n, p in model.named_parameters()] == param_set_shapes(name)


def test_resnet_parameter_set_counts():
    """The set without timm: ResNet-50's 25,557,032 parameters in 161 tensors, 53 of them conv kernels."""
    shapes = param_set_shapes("resnet50")
    assert len(shapes) == 161 and sum(math.prod(s) for _, s in shapes) == 25_557_032
    kernels = sorted(s[-2:] for _, s in shapes if len(s) == 4)
    assert len(kernels) == 53 and kernels.count((1, 1)) == 36 and kernels.count((3, 3)) == 16 and kernels[-1] == (7, 7)


def test_toy_lm_model_matches_its_parameter_set_and_learns():
    model = build_model("toy-lm", "cpu")
    assert [tuple(p.shape) for p in model.parameters()] == [s for _, s in param_set_shapes("toy-lm")]
    tokens = model.random_batch(seed=2)
    loss = model.loss(tokens).detach()
    logits = model.module(tokens).detach().double()
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 256), tokens[:, 1:].reshape(-1))
    assert float(loss) == pytest.approx(float(expected), rel=1e-6)


def test_building_a_model_leaves_the_global_rng_alone():
    state = torch.random.get_rng_state()
    first = build_model("toy-lm", "cpu", seed=3).parameters()
    assert torch.equal(torch.random.get_rng_state(), state)
    second = build_model("toy-lm", "cpu", seed=3).parameters()
    assert all(torch.equal(a, b) for a, b in zip(first, second))


# ---------------------------------------------------------------------------------------- CUDA


@pytest.mark.cuda
def test_step_mode_on_cuda_checks_fused_and_counts(tmp_path, capsys):
    out_json = tmp_path / "cuda.json"
    code = run_cli("bench", "--params", "toy-lm", "--steps", "3", "--quiet", "--json", out_json)
    assert code == 0, capsys.readouterr()
    record = json.loads(out_json.read_text())
    rows = {(r["optimizer"], r["contender"]): r for r in record["results"]}
    assert rows[("adamw", "adamw")]["backend"] == "fused"
    fused = rows[("small_fc_lopt", "fused")]
    assert fused["max_rel_error_vs_naive"] < 1e-5 and fused["launches_per_step"] > 0 and fused["peak_extra_mib"] > 0
    velo = rows.get(("velo", "fused"))
    if velo is None:  # no fused VeLO yet: listed with the constructor's reason
        reason = next(u["reason"] for u in record["unavailable"] if u["optimizer"] == "velo" and u["contender"] == "fused")
        assert reason
    else:
        assert velo["max_rel_error_vs_naive"] < 1e-4


@pytest.mark.cuda
def test_iteration_mode_and_curves_on_cuda(tmp_path, capsys):
    pytest.importorskip("transformers")
    out_json = tmp_path / "iteration.json"
    code = run_cli("bench", "--mode", "iteration", "--params", "tiny-lm", "--optimizer", "small_fc_lopt", "--steps", "2",
                   "--quiet", "--json", out_json, "--curves", tmp_path / "curves.png", "--curves-model", "gpt2-1x64",
                   "--curves-steps", "20")
    assert code == 0, capsys.readouterr()
    record = json.loads(out_json.read_text())
    assert record["settings"]["autocast"] == "bfloat16"
    fused = next(r for r in record["results"] if r["contender"] == "fused")
    assert fused["launches_per_step"] > 0 and fused["max_rel_error_vs_naive"] < 1e-5
    runs = record["curves"]["optimizers"]["small_fc_lopt"]
    assert set(runs["losses"]) == {"naive", "fused", curves.NUDGED_RUN}
    assert all(v is not None for v in runs["max_rel_diff_vs_naive"].values())


def test_no_module_in_lopt_bench_imports_the_optional_libraries_at_import_time():
    import subprocess

    code = ("import sys; import lopt.bench, lopt.bench.report, lopt.bench.curves, lopt.cli; "
            "print(sorted(m for m in ('transformers', 'timm', 'matplotlib') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stderr


# ---------------------------------------------------------------------------------------- muon and CELO2's routing


def test_muon_is_a_default_contender_of_the_orthogonalising_optimizers_alone():
    assert {name for name in registry.names() if registry.get(name).orthogonalizes} == {"celo2", "elo_celo2"}
    assert "muon" in contenders.default_contenders(["small_fc_lopt", "celo2"])
    assert "muon" in contenders.default_contenders(["elo_celo2"])
    assert contenders.default_contenders(["small_fc_lopt", "velo"]) == contenders.DEFAULT_CONTENDERS


def test_muon_row_is_timed_with_its_overhead_against_adamw():
    plan = runner.BenchPlan(mode="step", optimizers=["small_fc_lopt"], param_sets=["tiny-lm"],
                            contenders=["adamw", "muon"], device=torch.device("cpu"),
                            weights={"small_fc_lopt": lopt.random_weights("small_fc_lopt")}, steps=2, warmup=1,
                            show_progress=False)
    plan.availability = runner.probe_availability(plan)
    results, _ = runner.run_benchmarks(plan)
    muon = next(r for r in results if r.optimizer == "muon")
    adamw = next(r for r in results if r.optimizer == "adamw")
    assert muon.contender == "muon" and muon.backend == "muon+adamw-foreach" and muon.ms_per_step > 0
    assert muon.overhead_vs_adamw == pytest.approx(100 * (muon.ms_per_step / adamw.ms_per_step - 1))
    table = report.format_table(results, [], "step").splitlines()
    assert table[2].startswith("adamw") and table[3].split()[:3] == ["muon", "muon", "tiny-lm"]


def test_muon_contender_steps_matrices_as_torch_muon_and_the_rest_as_adamw():
    from lopt.param_sets import build_parameters, embedding_flags

    params = build_parameters("tiny-lm")
    flags = embedding_flags("tiny-lm")
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, c, g in zip(params, copies, measure.make_gradients(params)):
        p.grad, c.grad = g, g.clone()
    contender = contenders.make_contender("muon", "muon", params, None, torch.device("cpu"), embeddings=flags)
    matrices = [c for c, e in zip(copies, flags) if c.dim() == 2 and not e]
    rest = [c for c, e in zip(copies, flags) if not (c.dim() == 2 and not e)]
    assert matrices and rest and copies[0] in rest  # wte (2-d) is an embedding: AdamW's
    expected = [torch.optim.Muon(matrices, lr=1e-3, adjust_lr_fn="match_rms_adamw"),
                torch.optim.AdamW(rest, lr=1e-3, foreach=True)]
    before = [p.detach().clone() for p in params]
    for _ in range(2):
        contender.step(torch.tensor(2.5))
        for optimizer in expected:
            optimizer.step()
    for p, c, b in zip(params, copies, before):
        assert not torch.equal(p, b)
        torch.testing.assert_close(p, c, rtol=0, atol=0)


def test_muon_is_unavailable_with_the_reason_on_a_torch_without_it(monkeypatch):
    monkeypatch.delattr(torch.optim, "Muon", raising=False)
    plan = runner.BenchPlan(mode="step", optimizers=["celo2"], param_sets=["toy-lm"], contenders=["adamw", "muon"],
                            device=torch.device("cpu"), weights={"celo2": lopt.random_weights("celo2")}, steps=1,
                            warmup=0, show_progress=False)
    plan.availability = runner.probe_availability(plan)
    results, unavailable = runner.run_benchmarks(plan)
    assert [r.optimizer for r in results] == ["adamw"]
    muon = next(u for u in unavailable if u.optimizer == "muon")
    assert muon.reason.endswith("has no torch.optim.Muon (PyTorch 2.9 added it)")


@pytest.mark.parametrize("name", ["celo2", "elo_celo2"])
def test_celo2_routes_the_bench_embeddings_to_an_is_embedding_group(name):
    from lopt.param_sets import build_parameters, embedding_flags

    params = build_parameters("tiny-lm")
    contender = contenders.make_contender(name, "naive", params, lopt.random_weights("celo2"), torch.device("cpu"),
                                          embeddings=embedding_flags("tiny-lm"))
    embedding_groups = [g for g in contender.optimizer.param_groups if g["is_embedding"]]
    assert len(embedding_groups) == 1
    assert [id(p) for p in embedding_groups[0]["params"]] == [id(params[0]), id(params[1])]  # wte, wpe
    assert params[0].shape == (1024, 128)
    # other optimizers take the bare tensors as before
    other = contenders.make_contender("small_fc_lopt", "naive", params, lopt.random_weights("small_fc_lopt"),
                                      torch.device("cpu"), embeddings=embedding_flags("tiny-lm"))
    assert len(other.optimizer.param_groups) == 1


def test_embedding_flags_are_param_groups_for_on_the_built_models():
    from lopt.param_sets import embedding_flags

    model = build_model("toy-lm", torch.device("cpu"))
    assert runner.model_embedding_flags(model.module, model.parameters()) == embedding_flags("toy-lm") \
        == [True, False, False]
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        gpt2 = GPT2LMHeadModel(GPT2Config(**MODELS["gpt2-medium"].config))
    flags = runner.model_embedding_flags(gpt2, list(gpt2.parameters()))
    assert flags == embedding_flags("gpt2-medium") and flags[:2] == [True, True] and sum(flags) == 2
