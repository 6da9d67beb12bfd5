"""Lightning glue: :class:`VeLOLossCallback` hands every micro-batch's loss to :class:`lopt.VeLO`.

Lightning's automatic optimisation calls ``optimizer.step(closure=...)``, whose closure returns the
last micro-batch's loss divided by ``accumulate_grad_batches``; with ``16-mixed`` its GradScaler
calls ``optimizer.step()`` with no loss at all. The callback feeds each micro-batch's loss (as the
``training_step`` returned it: undivided, unscaled) to ``VeLO.accumulate_loss``, which takes
precedence, so every step uses the mean loss of its micro-batches::

    trainer = lightning.pytorch.Trainer(..., callbacks=[VeLOLossCallback()])

Works with ``lightning`` (``lightning.pytorch``) and ``pytorch_lightning``: the class is built on
first use from whichever is installed (``lightning`` first). ``SmallFCLOpt`` needs no callback.
"""

from __future__ import annotations

import warnings

from lopt.integrations._common import feed_loss, find_velo

__all__ = ["VeLOLossCallback"]


class _VeLOLossHooks:
    """The callback's hooks; :data:`VeLOLossCallback` adds Lightning's ``Callback`` base class."""

    def on_fit_start(self, trainer, pl_module) -> None:
        if not pl_module.automatic_optimization:
            raise RuntimeError(
                "VeLOLossCallback is for Lightning's automatic optimisation; with automatic_optimization = False "
                "call opt.step(loss) yourself (or opt.accumulate_loss(loss) per micro-batch) and drop the callback")
        velos = [velo for velo in map(find_velo, trainer.optimizers) if velo is not None]
        if not velos:
            raise ValueError("VeLOLossCallback: configure_optimizers() returned no lopt.VeLO; the callback is only "
                             "needed (and only works) with VeLO")
        steps = trainer.estimated_stepping_batches
        for velo in velos:
            if steps != float("inf") and velo.num_steps != steps:
                warnings.warn(
                    f"VeLO(num_steps={velo.num_steps}) but this fit will take {steps} optimizer steps "
                    f"(trainer.estimated_stepping_batches): pass num_steps=self.trainer.estimated_stepping_batches "
                    f"in configure_optimizers (optimizer steps, not micro-batches)", UserWarning, stacklevel=2)

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        # Lightning hands this hook the loss it back-propagates: divided by accumulate_grad_batches
        # and, under 16-mixed, multiplied by GradScaler's scale. Undo both (the scale is a power of
        # two, so dividing by it is exact) so that VeLO averages the training_step losses.
        velo = find_velo(trainer.optimizers[0])
        if velo is None:
            return
        feed_loss(velo, _unscaled(loss, trainer.precision_plugin), multiplier=trainer.accumulate_grad_batches)


def _unscaled(loss, precision_plugin):
    scaler = getattr(precision_plugin, "scaler", None)
    if scaler is None or not scaler.is_enabled():
        return loss
    # The scale tensor itself (read on its device: no synchronisation), as GradScaler.scale used it.
    scale = scaler._get_scale_async() if hasattr(scaler, "_get_scale_async") else scaler.get_scale()
    return loss / (scale.to(loss.device) if hasattr(scale, "to") else scale)


def _callback_base():
    try:
        from lightning.pytorch import Callback
    except ImportError:
        try:
            from pytorch_lightning import Callback
        except ImportError as err:
            raise ImportError("lopt.integrations.lightning.VeLOLossCallback needs Lightning: "
                              "pip install 'lopt[integrations]' (or lightning)") from err
    return Callback


def __getattr__(name: str):
    if name == "VeLOLossCallback":
        callback_class = type("VeLOLossCallback", (_VeLOLossHooks, _callback_base()), {
            "__module__": __name__,
            "__doc__": "Lightning callback: hands every micro-batch's training_step loss to the lopt.VeLO being "
                       "trained, so each step uses the mean loss of its micro-batches (any precision, any "
                       "accumulate_grad_batches).",
        })
        globals()["VeLOLossCallback"] = callback_class
        return callback_class
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
