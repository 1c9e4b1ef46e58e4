"""Dumping from PyTorch Lightning: a ``Callback`` that drives ``register_hooks``/
``remove_hooks`` from the trainer's own counters (``pip install 'h5cmp[lightning]'``).

The step window counts optimizer steps (``trainer.global_step`` before the step, from 0), the
epoch window ``trainer.current_epoch``. The ``LightningModule`` is hooked, so module paths
start with its attributes (``model.``): ``h5cmp`` pairs them with a plain run's by that prefix
and says so. With ``accumulate_grad_batches=k`` a dumped step holds its k micro-batches (each
record's ``micro_batch`` says which) and parameter gradients once, accumulated. With
``precision="16-mixed"`` the gradients' loss scale is recorded from the precision plugin's
GradScaler (unless the dumper was given a ``scaler``).
"""
from __future__ import annotations

from typing import Optional

from lightning.pytorch.callbacks import Callback

from .hooker import HookerAndDumper, given_or_new


class H5cmpLightningCallback(Callback):
    """``Trainer(callbacks=[H5cmpLightningCallback("dumps/", steps=[10])])``: the arguments are
    :class:`~dumper.HookerAndDumper`'s (or pass one as ``dumper=``)."""

    def __init__(self, *args, dumper: Optional[HookerAndDumper] = None, **options):
        self.dumper = given_or_new("H5cmpLightningCallback", dumper, args, options)
        self._step: Optional[int] = None  # the optimizer step whose micro-batches are hooked

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self._step is None:  # the first micro-batch of an optimizer step
            self._step = trainer.global_step
            if self.dumper.scaler is None:  # precision="16-mixed": its GradScaler
                self.dumper.scaler = getattr(trainer.precision_plugin, "scaler", None)
            self.dumper.register_hooks(pl_module, trainer.current_epoch, self._step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self._step is not None and trainer.global_step > self._step:  # the optimizer stepped
            self._end_step()

    def on_exception(self, trainer, pl_module, exception):
        """The step that raised is ended (:meth:`~dumper.HookerAndDumper.end_step_after`): no
        hook stays on the module, and a step the NaN/Inf sentinel stopped is published."""
        if self._step is not None:
            self._step = None
            self.dumper.end_step_after(exception)

    def on_train_end(self, trainer, pl_module):
        if self._step is not None:  # micro-batches of an optimizer step that never came
            self._end_step()
        self.dumper.close()

    def _end_step(self) -> None:
        self._step = None
        self.dumper.remove_hooks()
