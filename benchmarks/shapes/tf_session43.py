"""TensorFlow shapes of session 43 (MultiWorkerMirroredStrategy, 2 workers): --generator (Keras fit over
tf.data.Dataset.from_generator, a Python generator making each batch with NumPy), --mobilenet (Keras's
MobileNetV2, weights=None, 32x32 inputs, 10 classes: depthwise convolutions and BatchNorm, RMSprop)."""
import argparse, os, statistics, time
p = argparse.ArgumentParser(); p.add_argument("--steps", type=int, default=40)
for flag in ("--generator", "--mobilenet"):
    p.add_argument(flag, action="store_true")
a = p.parse_args()
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1"); os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np
import tensorflow as tf
keras = tf.keras
strategy = tf.distribute.MultiWorkerMirroredStrategy()
gb = 32 * strategy.num_replicas_in_sync
with strategy.scope():
    if a.mobilenet:
        model = keras.applications.MobileNetV2(input_shape=(32, 32, 3), alpha=0.35, weights=None, classes=10)
        opt = keras.optimizers.RMSprop(1e-3)
    else:
        model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(768, activation="relu"),
                                  keras.layers.Dense(768, activation="relu"), keras.layers.Dense(10)])
        opt = keras.optimizers.Adam(1e-3)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=not a.mobilenet))
shape = (32, 32, 3) if a.mobilenet else (256,)
if a.generator:
    def batches():
        rng = np.random.default_rng(0)
        while True:
            yield rng.standard_normal((gb, *shape), dtype=np.float32), rng.integers(0, 10, gb)
    train = tf.data.Dataset.from_generator(batches, output_signature=(
        tf.TensorSpec((gb, *shape), tf.float32), tf.TensorSpec((gb,), tf.int64)))
else:
    n = gb * 4
    train = tf.data.Dataset.from_tensor_slices((tf.random.normal((n, *shape)),
                                                tf.random.uniform((n,), maxval=10, dtype=tf.int64)))
    train = train.repeat().batch(gb)
train = train.prefetch(2)
times = []


class Timer(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        self.t = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        times.append(time.perf_counter() - self.t)


model.fit(train, steps_per_epoch=a.steps, epochs=1, verbose=0, callbacks=[Timer()])
if strategy.cluster_resolver.task_id == 0:
    print(f"median iteration time: {statistics.median(times[len(times)//2:]) * 1000:.3f} ms")
