"""Shared by the bundled tf-keras examples (tf_keras_fit, tf_keras_finetune): a callback that times
each training batch. Import it after the example has set TF_USE_LEGACY_KERAS (tf-keras), as the examples do."""
import time

import tensorflow as tf


class StepTimer(tf.keras.callbacks.Callback):
    """Seconds per training batch (one entry per call of the step function: per step unless steps_per_execution)."""

    def __init__(self):
        super().__init__()
        self.times, self.started = [], None

    def on_train_batch_begin(self, batch, logs=None):
        self.started = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter() - self.started)
