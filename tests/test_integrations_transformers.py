"""Recipe: Hugging Face transformers.Trainer with SmallFCLOpt and VeLO (docs/integrations.md), on CPU.

Each run is compared with the hand-written loop on the micro-batches the Trainer actually used
(recorded by the model), and VeLO's per-step losses with the micro-batch losses the model computed.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import lopt
from lopt import registry
from integrations_support import (
    SMALL_FC_WEIGHTS, assert_fed_means, assert_same_parameters, make_data, make_net, make_optimizer,
    reference_training)

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[test]')")
from lopt.integrations.transformers import LoptTrainer, VeLOLossMixin  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_intra_op_thread")

BATCH = 4
ACCUMULATION = 2


class RegressionModel(torch.nn.Module):
    """A tiny model in the Trainer's calling convention; records every training micro-batch and its loss.

    ``sum_reduction``: the loss is the sum of squared errors divided by ``num_items_in_batch`` (the
    Trainer's count over the whole accumulated batch), as causal LMs do.
    """

    def __init__(self, sum_reduction=False):
        super().__init__()
        self.net = make_net(seed=3)
        self.accepts_loss_kwargs = sum_reduction
        self.micro_batches = []  # (x, labels, loss) of every training forward

    def forward(self, x, labels, num_items_in_batch=None):
        prediction = self.net(x)
        if num_items_in_batch is not None:
            loss = ((prediction - labels) ** 2).sum() / num_items_in_batch
        else:
            loss = torch.nn.functional.mse_loss(prediction, labels)
        if self.training:
            self.micro_batches.append((x.clone(), labels.clone(), float(((prediction - labels) ** 2).mean().detach())))
        return {"loss": loss, "logits": prediction}


class DictDataset(torch.utils.data.Dataset):
    def __init__(self, num_samples):
        self.x, self.y = make_data(num_samples, seed=5)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


def training_args(tmp_path, **kwargs):
    defaults = dict(output_dir=str(tmp_path), per_device_train_batch_size=BATCH,
                    gradient_accumulation_steps=ACCUMULATION, num_train_epochs=1, max_grad_norm=0.0,
                    lr_scheduler_type="constant", report_to="none", save_strategy="no", logging_strategy="no",
                    use_cpu=True, seed=7, disable_tqdm=True, dataloader_num_workers=0)
    defaults.update(kwargs)
    return transformers.TrainingArguments(**defaults)


def recorded_steps(model, accumulation=ACCUMULATION):
    """The Trainer's micro-batches grouped into its optimizer steps (the last step may hold fewer)."""
    batches = [(x, y) for x, y, _ in model.micro_batches]
    return [batches[i:i + accumulation] for i in range(0, len(batches), accumulation)]


# 20 samples in micro-batches of 4 with 2 per step: steps of 2, 2 and 1 micro-batches (the Trainer
# divides the last step's loss by 1, not 2).
NUM_SAMPLES = 20
NUM_STEPS = 3


@pytest.mark.parametrize("sum_reduction", [False, True], ids=["mean-loss", "num_items_in_batch"])
def test_velo_with_lopt_trainer_sees_the_mean_loss_of_each_accumulated_batch(tmp_path, sum_reduction):
    model = RegressionModel(sum_reduction=sum_reduction)
    initial = RegressionModel(sum_reduction=sum_reduction)
    initial.load_state_dict(model.state_dict())
    velo = make_optimizer("velo", model.parameters(), num_steps=NUM_STEPS)
    trainer = LoptTrainer(model=model, args=training_args(tmp_path), train_dataset=DictDataset(NUM_SAMPLES),
                          optimizers=(velo, None))
    trainer.train()

    steps = recorded_steps(model)
    assert [len(s) for s in steps] == [2, 2, 1]
    assert velo.param_groups[0]["step"] == NUM_STEPS
    losses = [[loss for _, _, loss in model.micro_batches[i:i + ACCUMULATION]]
              for i in range(0, len(model.micro_batches), ACCUMULATION)]
    assert_fed_means(velo, losses)

    expected, _, expected_losses = reference_training(
        initial.net, steps, lambda m: make_optimizer("velo", m.parameters(), num_steps=NUM_STEPS))
    assert_same_parameters(model.net, expected, rtol=1e-6, atol=1e-8)
    # (the reference loop recomputed the same micro-batch losses from the same parameters)
    assert [[round(v, 5) for v in s] for s in expected_losses] == [[round(v, 5) for v in s] for s in losses]


def test_small_fc_lopt_through_optimizer_cls_and_kwargs_follows_lr_and_linear_schedule(tmp_path):
    """optimizer_cls_and_kwargs: the Trainer builds the optimizer with its weight-decay groups and
    lr from the kwargs (learning_rate is not used); the default linear schedule scales that lr down
    to 0 over the run. The hand-written loop applies the same groups and factors."""
    model = RegressionModel()
    initial_net = make_net(seed=3)
    args = training_args(tmp_path, lr_scheduler_type="linear", weight_decay=0.1, learning_rate=5e-5)
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=DictDataset(NUM_SAMPLES),
        optimizer_cls_and_kwargs=(lopt.SmallFCLOpt, {"weights": SMALL_FC_WEIGHTS, "backend": "naive", "lr": 0.5}))
    trainer.train()
    assert isinstance(trainer.optimizer.optimizer, lopt.SmallFCLOpt)

    def grouped_small_fc(net):
        weights = [p for n, p in net.named_parameters() if n.endswith("weight")]
        biases = [p for n, p in net.named_parameters() if n.endswith("bias")]
        return lopt.SmallFCLOpt([{"params": weights, "weight_decay": 0.1}, {"params": biases, "weight_decay": 0.0}],
                                lr=0.5, weights=SMALL_FC_WEIGHTS, backend="naive")

    linear = [(NUM_STEPS - t) / NUM_STEPS for t in range(NUM_STEPS)]
    expected, _, _ = reference_training(initial_net, recorded_steps(model), grouped_small_fc, lr_factors=linear)
    assert_same_parameters(model.net, expected, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("name", [name for name in registry.names() if name != "velo"])  # (VeLO: the mixin, above)
def test_each_optimizer_with_its_own_optimizer_and_scheduler(tmp_path, name):
    """Every registered optimizer that needs no loss, handed to the plain Trainer with a scheduler of its own
    (lr a tensor the scheduler changes in place): the run is the hand-written loop's."""
    lr = 0.8 if name in ("small_fc_lopt", "mulo") else 1e-3  # (a multiplier of the learned step; a step size)
    model = RegressionModel()
    initial_net = make_net(seed=3)
    opt = make_optimizer(name, model.net.parameters(), lr=torch.tensor(lr))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 0.5 ** t)
    transformers.Trainer(model=model, args=training_args(tmp_path), train_dataset=DictDataset(NUM_SAMPLES),
                         optimizers=(opt, sched)).train()
    halving = [0.5 ** t for t in range(NUM_STEPS)]
    expected, _, _ = reference_training(
        initial_net, recorded_steps(model), lambda m: make_optimizer(name, m.parameters(), lr=lr),
        lr_factors=halving)
    assert_same_parameters(model.net, expected, rtol=1e-6, atol=1e-8)


def test_plain_trainer_with_velo_fails_with_a_message_naming_both_ways(tmp_path):
    model = RegressionModel()
    velo = make_optimizer("velo", model.parameters(), num_steps=NUM_STEPS)
    trainer = transformers.Trainer(model=model, args=training_args(tmp_path, max_steps=1),
                                   train_dataset=DictDataset(NUM_SAMPLES), optimizers=(velo, None))
    with pytest.raises(TypeError, match=r"opt\.step\(loss\).*accumulate_loss"):
        trainer.train()
    assert velo.param_groups[0]["step"] == 0


def test_mixin_warns_about_num_steps_and_a_decaying_schedule(tmp_path):
    model = RegressionModel()
    velo = make_optimizer("velo", model.parameters(), num_steps=50)
    trainer = LoptTrainer(model=model, args=training_args(tmp_path, lr_scheduler_type="linear"),
                          train_dataset=DictDataset(NUM_SAMPLES), optimizers=(velo, None))
    with pytest.warns(UserWarning) as caught:
        trainer.create_scheduler(num_training_steps=NUM_STEPS)
    messages = [str(w.message) for w in caught]
    assert any("VeLO(num_steps=50) but the Trainer will take 3 optimizer steps" in m for m in messages), messages
    assert any("'linear' learning-rate schedule" in m and "lr_scheduler_type='constant'" in m for m in messages)

    # num_steps right and a constant schedule: nothing to say.
    trainer = LoptTrainer(model=model, args=training_args(tmp_path),
                          train_dataset=DictDataset(NUM_SAMPLES), optimizers=(velo, None))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer.create_scheduler(num_training_steps=50)


def test_mixin_composes_with_a_trainer_subclass_and_leaves_small_fc_lopt_alone(tmp_path):
    class CustomTrainer(transformers.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    class VeLOCustomTrainer(VeLOLossMixin, CustomTrainer):
        pass

    model = RegressionModel()
    velo = make_optimizer("velo", model.parameters(), num_steps=NUM_STEPS)
    VeLOCustomTrainer(model=model, args=training_args(tmp_path), train_dataset=DictDataset(NUM_SAMPLES),
                      optimizers=(velo, None)).train()
    assert [len(fed) for fed in velo.fed] == [2, 2, 1]

    model = RegressionModel()
    opt = make_optimizer("small_fc_lopt", model.parameters())
    LoptTrainer(model=model, args=training_args(tmp_path), train_dataset=DictDataset(NUM_SAMPLES),
                optimizers=(opt, None)).train()
    assert opt.param_groups[0]["step"] == NUM_STEPS


def test_lopt_trainer_is_built_lazily_and_picklable_by_name():
    import pickle

    from lopt.integrations import transformers as glue

    assert glue.LoptTrainer.__module__ == "lopt.integrations.transformers"
    assert issubclass(glue.LoptTrainer, transformers.Trainer) and issubclass(glue.LoptTrainer, VeLOLossMixin)
    assert pickle.loads(pickle.dumps(glue.LoptTrainer)) is glue.LoptTrainer
    with pytest.raises(AttributeError, match="has no attribute 'Missing'"):
        glue.Missing  # noqa: B018
