"""A rich progress bar for `keras.Model.fit`, shared by the RNN and captioning examples.

Import it after the Keras backend is chosen (see `_threads.limit_threads`): it imports Keras.
"""

from __future__ import annotations

import keras
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class RichProgress(keras.callbacks.Callback):
    """One bar over all training batches, showing the epoch and the running loss."""

    def __init__(self, epochs: int, steps_per_epoch: int, label: str = "training"):
        super().__init__()
        self.epochs = epochs
        self.total = epochs * steps_per_epoch
        self.label = label
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("epoch {task.fields[epoch]}/{task.fields[epochs]}"),
            TextColumn("loss {task.fields[loss]}"),
            TimeElapsedColumn(),
        )
        self.task = None
        self.epoch = 0

    def on_train_begin(self, logs=None):
        self.progress.start()
        self.task = self.progress.add_task(
            self.label, total=self.total, epoch=1, epochs=self.epochs, loss="-"
        )

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch + 1

    def on_train_batch_end(self, batch, logs=None):
        loss = (logs or {}).get("loss")
        self.progress.update(
            self.task,
            advance=1,
            epoch=self.epoch,
            loss="-" if loss is None else f"{float(loss):.4f}",
        )

    def on_train_end(self, logs=None):
        self.progress.stop()
