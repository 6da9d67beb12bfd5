"""Recipe: Lightning's automatic optimisation with SmallFCLOpt and VeLO (docs/integrations.md), on CPU.

Gradient accumulation, 16-mixed with Lightning's own GradScaler path (its MixedPrecision plugin with
a CPU GradScaler: Lightning turns precision="16-mixed" into bf16 on a CPU), bf16-mixed, and exact
resume from a checkpoint. Every run is compared with the hand-written loop on the same micro-batches.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from lopt import registry

from integrations_support import (
    assert_fed_means, assert_same_parameters, make_data, make_net, make_optimizer, mse, reference_training)

L = pytest.importorskip("lightning.pytorch", reason="lightning is not installed (pip install -e '.[test]')")
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402

from lopt.integrations.lightning import GradientClippingCallback, VeLOLossCallback  # noqa: E402

pytestmark = [pytest.mark.usefixtures("single_intra_op_thread"),
              pytest.mark.filterwarnings("ignore::UserWarning:lightning"),
              pytest.mark.filterwarnings("ignore:.*LeafSpec")]

BATCH = 4
NUM_SAMPLES = 20  # 5 micro-batches an epoch: with accumulate_grad_batches=2, steps of 2, 2 and 1


class RegressionModule(L.LightningModule):
    """Records every training micro-batch and its loss (float64, as training_step returned it)."""

    def __init__(self, optimizer_name="velo", num_steps=None, **optimizer_kwargs):
        super().__init__()
        self.net = make_net(seed=3)
        self.optimizer_name, self.num_steps, self.optimizer_kwargs = optimizer_name, num_steps, optimizer_kwargs
        self.micro_batches = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = mse(self.net(x), y)
        self.micro_batches.append((x.clone(), y.clone(), float(loss.detach().double())))
        return loss

    def configure_optimizers(self):
        num_steps = self.num_steps or self.trainer.estimated_stepping_batches
        return make_optimizer(self.optimizer_name, self.parameters(), num_steps=num_steps, **self.optimizer_kwargs)

    def steps(self, accumulation):
        """Recorded micro-batches grouped into optimizer steps, epoch by epoch (as Lightning steps)."""
        per_epoch = -(-NUM_SAMPLES // BATCH)
        grouped, losses = [], []
        for start in range(0, len(self.micro_batches), per_epoch):
            epoch = self.micro_batches[start:start + per_epoch]
            for i in range(0, len(epoch), accumulation):
                grouped.append([(x, y) for x, y, _ in epoch[i:i + accumulation]])
                losses.append([loss for _, _, loss in epoch[i:i + accumulation]])
        return grouped, losses


def loader():
    x, y = make_data(NUM_SAMPLES, seed=5)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH, shuffle=False)


def make_trainer(**kwargs):
    defaults = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False, num_sanity_val_steps=0, max_epochs=1)
    defaults.update(kwargs)
    return L.Trainer(**defaults)


def fp16_mixed_with_grad_scaler():
    """What precision="16-mixed" is on a GPU, on the CPU: Lightning's MixedPrecision plugin with a GradScaler."""
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))


PRECISIONS = {
    "32": (dict(), dict()),
    "16-mixed-grad-scaler": (lambda: dict(plugins=[fp16_mixed_with_grad_scaler()]),
                             lambda: dict(autocast_dtype=torch.float16, scaler=torch.amp.GradScaler("cpu"))),
    "bf16-mixed": (dict(precision="bf16-mixed"), dict(autocast_dtype=torch.bfloat16)),
}


def _resolve(options):
    return options() if callable(options) else dict(options)


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_velo_callback_feeds_the_mean_micro_batch_loss(precision):
    trainer_options, reference_options = PRECISIONS[precision]
    module = RegressionModule("velo")
    initial_net = make_net(seed=3)
    trainer = make_trainer(accumulate_grad_batches=2, callbacks=[VeLOLossCallback()], **_resolve(trainer_options))
    trainer.fit(module, loader())

    velo = trainer.optimizers[0]
    steps, losses = module.steps(accumulation=2)
    assert [len(s) for s in steps] == [2, 2, 1]
    assert velo.num_steps == 3 and velo.param_groups[0]["step"] == 3
    assert_fed_means(velo, losses)
    expected, _, _ = reference_training(
        initial_net, steps, lambda m: make_optimizer("velo", m.parameters(), num_steps=3), gradient_divisor=2,
        **_resolve(reference_options))
    assert_same_parameters(module.net, expected, rtol=1e-6, atol=1e-8)


def test_small_fc_lopt_needs_no_callback_with_accumulation_and_grad_scaler():
    module = RegressionModule("small_fc_lopt", lr=0.7)
    initial_net = make_net(seed=3)
    make_trainer(accumulate_grad_batches=2, plugins=[fp16_mixed_with_grad_scaler()]).fit(module, loader())
    steps, _ = module.steps(accumulation=2)
    expected, _, _ = reference_training(
        initial_net, steps, lambda m: make_optimizer("small_fc_lopt", m.parameters(), lr=0.7),
        autocast_dtype=torch.float16, scaler=torch.amp.GradScaler("cpu"), gradient_divisor=2)
    assert_same_parameters(module.net, expected)


@pytest.mark.parametrize("optimizer_name", registry.names())
def test_resume_from_a_checkpoint_continues_exactly(tmp_path, optimizer_name):
    """Two epochs in one run equal one epoch, a checkpoint, and a second epoch in a new process's
    objects (16-mixed with its GradScaler, accumulation of 2)."""

    def run(max_epochs, ckpt_path=None):
        module = RegressionModule(optimizer_name, num_steps=6)
        callbacks = [VeLOLossCallback()] if optimizer_name == "velo" else []
        trainer = make_trainer(max_epochs=max_epochs, accumulate_grad_batches=2, callbacks=callbacks,
                               plugins=[fp16_mixed_with_grad_scaler()])
        trainer.fit(module, loader(), ckpt_path=ckpt_path)
        return module, trainer

    straight, straight_trainer = run(max_epochs=2)
    first, first_trainer = run(max_epochs=1)
    first_trainer.save_checkpoint(tmp_path / "epoch1.ckpt")
    resumed, resumed_trainer = run(max_epochs=2, ckpt_path=tmp_path / "epoch1.ckpt")

    assert len(resumed.micro_batches) == len(straight.micro_batches) // 2  # only the second epoch ran
    assert_same_parameters(resumed.net, straight.net)
    straight_state = straight_trainer.optimizers[0].state_dict()
    resumed_state = resumed_trainer.optimizers[0].state_dict()
    for index, values in straight_state["state"].items():
        for key, value in values.items():
            assert torch.equal(resumed_state["state"][index][key], value), (index, key)
    if optimizer_name == "velo":
        for key in ("loss_means", "loss_running_min", "loss_count"):
            assert torch.equal(resumed_state["param_groups"][0][key], straight_state["param_groups"][0][key]), key


CLIP = 0.02  # below every step's gradient norm here: each step is clipped


def clipping_callbacks(optimizer_name):
    return [VeLOLossCallback()] if optimizer_name == "velo" else [GradientClippingCallback()]


@pytest.mark.parametrize("optimizer_name", registry.names())
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed-grad-scaler"])
def test_gradient_clipping_under_mixed_precision(optimizer_name, precision):
    """gradient_clip_val under bf16-mixed and 16-mixed (with its GradScaler) clips as the hand-written loop
    does (GradScaler: unscale_, clip_grad_norm_, step); the optimizer's own attribute is restored afterwards."""
    trainer_options, reference_options = PRECISIONS[precision]
    module = RegressionModule(optimizer_name)
    initial_net = make_net(seed=3)
    trainer = make_trainer(accumulate_grad_batches=2, gradient_clip_val=CLIP, callbacks=clipping_callbacks(optimizer_name),
                           **_resolve(trainer_options))
    trainer.fit(module, loader())
    opt = trainer.optimizers[0]
    assert opt.param_groups[0]["step"] == 3 and opt._step_supports_amp_scaling is True
    assert "_step_supports_amp_scaling" not in vars(opt)
    steps, losses = module.steps(accumulation=2)
    norms = []
    expected, _, _ = reference_training(
        initial_net, steps, lambda m: make_optimizer(optimizer_name, m.parameters(), num_steps=3), gradient_divisor=2,
        clip_norm=CLIP, grad_norms=norms, **_resolve(reference_options))
    assert len(norms) == 3 and min(norms) > 2 * CLIP  # clipping changed every step's gradients
    assert_same_parameters(module.net, expected, rtol=1e-6, atol=1e-8)
    if optimizer_name == "velo":
        assert_fed_means(opt, losses)


def test_velo_under_16_mixed_with_clipping_drops_the_losses_of_an_overflowing_step():
    """With clipping, Lightning's GradScaler skips an overflowing step without calling step(): VeLO's next step
    still averages only its own micro-batches, as when VeLO skips the step itself (the hand-written loop)."""
    def scaler():  # the first step overflows in float16, the next ones do not
        return torch.amp.GradScaler("cpu", init_scale=2.0 ** 30, backoff_factor=2.0 ** -20)

    module = RegressionModule("velo", num_steps=3)
    initial_net = make_net(seed=3)
    trainer = make_trainer(accumulate_grad_batches=2, gradient_clip_val=CLIP, callbacks=[VeLOLossCallback()],
                           plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler())])
    trainer.fit(module, loader())
    steps, _ = module.steps(accumulation=2)
    expected, expected_opt, _ = reference_training(
        initial_net, steps, lambda m: make_optimizer("velo", m.parameters(), num_steps=3), gradient_divisor=2,
        clip_norm=CLIP, autocast_dtype=torch.float16, scaler=scaler())
    velo = trainer.optimizers[0]
    # 3 windows, the first one's step skipped (in the hand-written loop by VeLO itself, on GradScaler's found_inf)
    assert velo.param_groups[0]["step"] == expected_opt.param_groups[0]["step"] == 2
    assert_same_parameters(module.net, expected, rtol=1e-6, atol=1e-8)
    for key in ("loss_means", "loss_running_min", "loss_count"):  # the losses VeLO used, step by step
        torch.testing.assert_close(velo.param_groups[0][key], expected_opt.param_groups[0][key], rtol=1e-6, atol=0)


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed-grad-scaler"])
def test_without_the_callback_lightning_refuses_to_clip(precision):
    """Lightning's own check (lopt's optimizers unscale inside step(), as fused AdamW does): the reason for
    GradientClippingCallback. If a Lightning release lifts it, docs/integrations.md §5 should say so."""
    trainer_options, _ = PRECISIONS[precision]
    trainer = make_trainer(gradient_clip_val=1.0, **_resolve(trainer_options))
    with pytest.raises(RuntimeError, match="does not allow for gradient clipping because it performs unscaling"):
        trainer.fit(RegressionModule("small_fc_lopt"), loader())


def test_callback_refuses_manual_optimisation_and_optimizers_other_than_velo():
    class Manual(RegressionModule):
        def __init__(self):
            super().__init__("velo", num_steps=3)
            self.automatic_optimization = False

    with pytest.raises(RuntimeError, match="automatic optimisation.*opt.step\\(loss\\)"):
        make_trainer(callbacks=[VeLOLossCallback()]).fit(Manual(), loader())
    with pytest.raises(ValueError, match="no lopt.VeLO"):
        make_trainer(callbacks=[VeLOLossCallback()]).fit(RegressionModule("small_fc_lopt"), loader())


def test_callback_warns_when_num_steps_is_not_the_number_of_optimizer_steps():
    module = RegressionModule("velo", num_steps=5)  # 5 micro-batches, but 3 optimizer steps
    with pytest.warns(UserWarning, match=r"VeLO\(num_steps=5\) but this fit will take 3 optimizer steps"):
        make_trainer(accumulate_grad_batches=2, callbacks=[VeLOLossCallback()]).fit(module, loader())


def test_without_the_callback_velo_fails_under_16_mixed_with_a_message_naming_both_ways():
    """Lightning's GradScaler path calls optimizer.step() with no loss: the error says what to do."""
    module = RegressionModule("velo", num_steps=3)
    with pytest.raises(TypeError, match=r"opt\.step\(loss\).*accumulate_loss"):
        make_trainer(plugins=[fp16_mixed_with_grad_scaler()]).fit(module, loader())


def test_callback_works_with_the_pytorch_lightning_namespace():
    pl = pytest.importorskip("pytorch_lightning", reason="pytorch_lightning is not installed")

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = make_net(seed=3)
            self.losses = []

        def training_step(self, batch, batch_idx):
            loss = mse(self.net(batch[0]), batch[1])
            self.losses.append(float(loss.detach().double()))
            return loss

        def configure_optimizers(self):
            return make_optimizer("velo", self.parameters(), num_steps=3)

    module = Module()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, max_epochs=1, accumulate_grad_batches=2,
                   callbacks=[VeLOLossCallback()]).fit(module, loader())
    velo = module.trainer.optimizers[0]
    assert_fed_means(velo, [module.losses[0:2], module.losses[2:4], module.losses[4:5]])


@pytest.mark.cuda
def test_real_16_mixed_on_a_gpu_velo_callback_and_fused_small_fc_lopt():
    """precision="16-mixed" on a GPU (Lightning's own CUDA GradScaler): VeLO (naive: it has no fused
    backend yet) gets the mean micro-batch losses; SmallFCLOpt's fused step matches its naive step."""
    module = RegressionModule("velo")
    trainer = make_trainer(accelerator="gpu", precision="16-mixed", accumulate_grad_batches=2,
                           callbacks=[VeLOLossCallback()])
    trainer.fit(module, loader())
    assert isinstance(trainer.precision_plugin.scaler, torch.amp.GradScaler)
    _, losses = module.steps(accumulation=2)
    assert_fed_means(trainer.optimizers[0], losses)

    nets = {}
    for backend in ("fused", "naive"):
        module = RegressionModule("small_fc_lopt", backend=backend)
        trainer = make_trainer(accelerator="gpu", precision="16-mixed", accumulate_grad_batches=2)
        trainer.fit(module, loader())
        assert trainer.optimizers[0].backend == backend and trainer.optimizers[0].param_groups[0]["step"] == 3
        nets[backend] = module.net
    assert_same_parameters(nets["fused"], nets["naive"], rtol=1e-4, atol=1e-6)
