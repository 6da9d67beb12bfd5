"""Recipe: Lightning's automatic optimisation with SmallFCLOpt and VeLO (docs/integrations.md), on CPU.

Gradient accumulation, 16-mixed with Lightning's own GradScaler path (its MixedPrecision plugin with
a CPU GradScaler: Lightning turns precision="16-mixed" into bf16 on a CPU), bf16-mixed, and exact
resume from a checkpoint. Every run is compared with the hand-written loop on the same micro-batches.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from integrations_support import (
    assert_fed_means, assert_same_parameters, make_data, make_net, make_optimizer, mse, reference_training)

L = pytest.importorskip("lightning.pytorch", reason="lightning is not installed (pip install -e '.[test]')")
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402

from lopt.integrations.lightning import VeLOLossCallback  # noqa: E402

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


@pytest.mark.parametrize("optimizer_name", ["velo", "small_fc_lopt"])
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
