"""Lightning glue: :class:`VeLOLossCallback` hands every micro-batch's loss to :class:`lopt.VeLO`;
:class:`GradientClippingCallback` (included in ``VeLOLossCallback``) lets Lightning clip the gradients
(``gradient_clip_val``) of lopt's optimizers under ``16-mixed`` and ``bf16-mixed``.

Lightning's automatic optimisation calls ``optimizer.step(closure=...)``, whose closure returns the
last micro-batch's loss divided by ``accumulate_grad_batches``; with ``16-mixed`` its GradScaler
calls ``optimizer.step()`` with no loss at all. The callback feeds each micro-batch's loss (as the
``training_step`` returned it: undivided, unscaled) to ``VeLO.accumulate_loss``, which takes
precedence, so every step uses the mean loss of its micro-batches::

    trainer = lightning.pytorch.Trainer(..., callbacks=[VeLOLossCallback()])

Lightning's mixed-precision plugin refuses to clip for an optimizer that declares
``_step_supports_amp_scaling`` (it unscales GradScaler's gradients inside ``step()``, as fused AdamW
does), also under ``bf16-mixed``, which has no GradScaler. During ``fit`` with clipping configured,
the callbacks set that attribute to False on the lopt optimizer instance: under ``bf16-mixed`` that
only lifts the refusal; under ``16-mixed`` Lightning then unscales the gradients before clipping and
GradScaler steps the optimizer the standard way (the step is skipped on an overflow; as for any
optimizer, this reads GradScaler's overflow flag on the host once per step). ``teardown`` restores
the attribute.

Works with ``lightning`` (``lightning.pytorch``) and ``pytorch_lightning``: the classes are built on
first use from whichever is installed (``lightning`` first). ``SmallFCLOpt`` needs no callback
(``GradientClippingCallback`` where the gradients are clipped under mixed precision).
"""

from __future__ import annotations

import warnings

from lopt.integrations._common import discard_pending_losses, feed_loss, find_learned_optimizer, find_velo

__all__ = ["VeLOLossCallback", "GradientClippingCallback"]

_AMP_ATTRIBUTE = "_step_supports_amp_scaling"


class _ClippingHooks:
    """Lets Lightning clip lopt optimizers' gradients under mixed precision (see the module docstring)."""

    def on_fit_start(self, trainer, pl_module) -> None:
        self._lopt_restore = []
        if not _clipping_configured(trainer, pl_module):
            return
        for optimizer in trainer.optimizers:
            learned = find_learned_optimizer(optimizer)
            if learned is not None and _AMP_ATTRIBUTE not in vars(learned):
                setattr(learned, _AMP_ATTRIBUTE, False)  # (an instance attribute: the class keeps its own)
                self._lopt_restore.append(learned)

    def teardown(self, trainer, pl_module, stage) -> None:
        for learned in getattr(self, "_lopt_restore", ()):
            vars(learned).pop(_AMP_ATTRIBUTE, None)
        self._lopt_restore = []


def _clipping_configured(trainer, pl_module) -> bool:
    """``gradient_clip_val`` is set, or the module clips in its own ``configure_gradient_clipping``."""
    if trainer.gradient_clip_val:
        return True
    base = next((cls for cls in type(pl_module).__mro__ if cls.__name__ == "LightningModule"), None)
    return base is not None and type(pl_module).configure_gradient_clipping is not base.configure_gradient_clipping


class _VeLOLossHooks(_ClippingHooks):
    """The callback's hooks; :data:`VeLOLossCallback` adds Lightning's ``Callback`` base class."""

    def on_fit_start(self, trainer, pl_module) -> None:
        super().on_fit_start(trainer, pl_module)
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

    def on_before_zero_grad(self, trainer, pl_module, optimizer) -> None:
        # A new accumulation window starts (Lightning zeroes the gradients at its first micro-batch,
        # before that micro-batch's backward). Losses still pending belong to a window whose step
        # GradScaler skipped without calling step() (its standard path, with clipping under
        # 16-mixed): drop them, as VeLO's own skip does.
        velo = find_velo(optimizer)
        if velo is not None:
            discard_pending_losses(velo)

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
            raise ImportError("lopt.integrations.lightning's callbacks need Lightning: "
                              "pip install -e '.[integrations]' in the lopt checkout (or pip install lightning)") from err
    return Callback


def __getattr__(name: str):
    if name == "GradientClippingCallback":
        callback_class = type("GradientClippingCallback", (_ClippingHooks, _callback_base()), {
            "__module__": __name__,
            "__doc__": "Lightning callback: lets Lightning clip the gradients (gradient_clip_val) of lopt's "
                       "optimizers under 16-mixed and bf16-mixed precision (VeLOLossCallback includes it).",
        })
        globals()["GradientClippingCallback"] = callback_class
        return callback_class
    if name == "VeLOLossCallback":
        callback_class = type("VeLOLossCallback", (_VeLOLossHooks, _callback_base()), {
            "__module__": __name__,
            "__doc__": "Lightning callback: hands every micro-batch's training_step loss to the lopt.VeLO being "
                       "trained, so each step uses the mean loss of its micro-batches (any precision, any "
                       "accumulate_grad_batches); like GradientClippingCallback, it lets Lightning clip the "
                       "gradients under 16-mixed and bf16-mixed.",
        })
        globals()["VeLOLossCallback"] = callback_class
        return callback_class
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
