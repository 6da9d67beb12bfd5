"""Hugging Face ``transformers.Trainer`` glue: every micro-batch's loss reaches :class:`lopt.VeLO`.

``Trainer`` calls ``optimizer.step()`` without a loss, once per ``gradient_accumulation_steps``
micro-batches. :class:`VeLOLossMixin` hands each micro-batch's loss to ``VeLO.accumulate_loss``,
so the step uses the loss of the whole accumulated batch::

    from lopt.integrations.transformers import LoptTrainer
    trainer = LoptTrainer(model=model, args=args, train_dataset=ds, optimizers=(velo, None))

``SmallFCLOpt`` needs no glue (``LoptTrainer`` leaves it alone). ``transformers`` is imported only
when :class:`LoptTrainer` is first used; the mixin itself needs nothing. See ``docs/integrations.md``.
"""

from __future__ import annotations

import warnings

from lopt.integrations._common import feed_loss, find_velo

__all__ = ["VeLOLossMixin", "LoptTrainer"]


class VeLOLossMixin:
    """Mix into ``transformers.Trainer`` or a subclass of it (``class MyTrainer(VeLOLossMixin, SFTTrainer)``).

    - ``training_step``: hands the micro-batch's loss to the VeLO the Trainer steps (none: no-op).
    - ``create_scheduler``: warns when the Trainer will take a number of optimizer steps other
      than ``VeLO(num_steps=...)``, or builds a decaying schedule for VeLO (VeLO schedules itself).
    """

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        velo = find_velo(self.optimizer)
        if velo is not None:
            # Trainer returns the loss as it back-propagated it: divided by this step's number of
            # micro-batches, or already normalised over the whole accumulated batch (models that take
            # num_items_in_batch). Either way this step's values sum to the loss of the accumulated
            # batch, so each times the number of micro-batches averages to it.
            micro_batches = getattr(self, "current_gradient_accumulation_steps", self.args.gradient_accumulation_steps)
            feed_loss(velo, loss, multiplier=micro_batches)
        return loss

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        creates_schedule = self.lr_scheduler is None
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        velo = find_velo(optimizer if optimizer is not None else self.optimizer)
        if velo is not None:
            _check_velo_plan(velo, num_training_steps, self.args.lr_scheduler_type if creates_schedule else None)
        return scheduler


def _check_velo_plan(velo, num_training_steps: int, created_schedule_type) -> None:
    if velo.num_steps != num_training_steps:
        warnings.warn(
            f"VeLO(num_steps={velo.num_steps}) but the Trainer will take {num_training_steps} optimizer steps: VeLO's "
            f"features count progress through num_steps, so pass num_steps={num_training_steps} (the number of "
            f"optimizer steps, i.e. TrainingArguments.max_steps, not of micro-batches)", UserWarning, stacklevel=3)
    schedule = str(getattr(created_schedule_type, "value", created_schedule_type))
    if created_schedule_type is not None and schedule not in ("constant", "constant_with_warmup"):
        warnings.warn(
            f"the Trainer made a {schedule!r} learning-rate schedule for VeLO; VeLO schedules its own step through "
            f"num_steps and lr multiplies that step, so lr_scheduler_type='constant' (with VeLO's lr=1.0) is what it "
            f"was meta-trained for", UserWarning, stacklevel=3)


def __getattr__(name: str):
    # LoptTrainer subclasses transformers.Trainer: built on first use, so importing this module
    # (or lopt) does not import transformers.
    if name == "LoptTrainer":
        try:
            from transformers import Trainer
        except ImportError as err:
            raise ImportError("lopt.integrations.transformers.LoptTrainer needs transformers: "
                              "pip install -e '.[integrations]' in the lopt checkout (or pip install transformers)") from err

        trainer_class = type("LoptTrainer", (VeLOLossMixin, Trainer), {
            "__module__": __name__,
            "__doc__": "``transformers.Trainer`` that hands every micro-batch's loss to a ``lopt.VeLO`` "
                       "(see :class:`VeLOLossMixin`); with any other optimizer it is the plain Trainer.",
        })
        globals()["LoptTrainer"] = trainer_class
        return trainer_class
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
