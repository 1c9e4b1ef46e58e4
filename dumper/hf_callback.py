"""Dumping from Hugging Face ``Trainer``: a ``TrainerCallback`` that drives
``register_hooks``/``remove_hooks`` from the trainer's own counters (``pip install
'h5cmp[hf]'``).

The step window counts optimizer steps (``state.global_step`` before the step, from 0), the
epoch window the trainer's epochs (from 0). With gradient accumulation a dumped step holds
every micro-batch: each record's ``micro_batch`` says which (each module's calls are numbered
on through the micro-batches), and parameter gradients are recorded once, accumulated. Compare
pairs records by ``call_idx``, so micro-batch by micro-batch. With ``fp16=True`` the gradients'
loss scale is recorded from the GradScaler accelerate steps the optimizer with (unless the
dumper was given a ``scaler``).
"""
from __future__ import annotations

from typing import Optional

from transformers import TrainerCallback

from .hooker import HookerAndDumper, given_or_new


class H5cmpCallback(TrainerCallback):
    """``Trainer(..., callbacks=[H5cmpCallback("dumps/", steps=[10, 11])])``: the arguments are
    :class:`~dumper.HookerAndDumper`'s (or pass one as ``dumper=``). An exception that ends
    ``train()`` mid-step (a :class:`~dumper.NonFiniteError`) skips ``on_step_end``: call
    ``callback.dumper.remove_hooks()`` (publishes the step so far) or ``close()`` after it."""

    def __init__(self, *args, dumper: Optional[HookerAndDumper] = None, **options):
        self.dumper = given_or_new("H5cmpCallback", dumper, args, options)
        self._epoch = 0

    def on_epoch_begin(self, args, state, control, **kwargs):
        self._epoch = int(state.epoch or 0)  # whole epochs done (also after a resume)

    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self.dumper.scaler is None:  # fp16 mixed precision: accelerate's GradScaler
            self.dumper.scaler = getattr(optimizer, "scaler", None)
        self.dumper.register_hooks(model, self._epoch, state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        self.dumper.remove_hooks()

    def on_train_end(self, args, state, control, **kwargs):
        self.dumper.close()
