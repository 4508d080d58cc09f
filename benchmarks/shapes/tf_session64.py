"""TensorFlow shapes of session 64 (MultiWorkerMirroredStrategy, 2 workers): --lr-schedule-validation-split (tf-keras
fit on NumPy arrays with validation_split=0.2, a LearningRateScheduler callback and an EarlyStopping that never
fires), --two-optimizers-persistent-tape (a custom loop whose step takes one persistent GradientTape and applies the
trunk's gradients with Adam and the head's with SGD), --masked-lstm-fit (tf-keras fit of an Embedding with
mask_zero=True and an LSTM over sequences padded with zeros)."""
import argparse, os, statistics, time
p = argparse.ArgumentParser(); p.add_argument("--steps", type=int, default=40)
for flag in ("--lr-schedule-validation-split", "--two-optimizers-persistent-tape", "--masked-lstm-fit"):
    p.add_argument(flag, action="store_true")
a = p.parse_args()
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np
import tensorflow as tf
keras = tf.keras
strategy = tf.distribute.MultiWorkerMirroredStrategy()
per_replica = 32
gb = per_replica * strategy.num_replicas_in_sync
times = []


class Timer(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        self.start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        times.append(time.perf_counter() - self.start)


if a.lr_schedule_validation_split:
    with strategy.scope():
        model = keras.Sequential([keras.Input((128,)), keras.layers.Dense(512, activation="relu"),
                                  keras.layers.Dense(512, activation="relu"), keras.layers.Dense(10)])
        model.compile(keras.optimizers.SGD(0.05, momentum=0.9),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    rng = np.random.default_rng(0)
    n = gb * 10
    x, y = rng.normal(size=(n, 128)).astype("float32"), rng.integers(0, 10, size=(n,))
    epochs = max(1, a.steps // 8)
    model.fit(x, y, batch_size=gb, epochs=epochs, validation_split=0.2, verbose=0,
              callbacks=[Timer(), keras.callbacks.LearningRateScheduler(lambda e, lr: lr * 0.9),
                         keras.callbacks.EarlyStopping(monitor="val_loss", patience=100)])
elif a.masked_lstm_fit:
    VOCAB, SEQ = 500, 32
    with strategy.scope():
        model = keras.Sequential([keras.Input((SEQ,)), keras.layers.Embedding(VOCAB, 64, mask_zero=True),
                                  keras.layers.LSTM(128), keras.layers.Dense(10)])
        model.compile(keras.optimizers.Adam(1e-3), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    n = gb * 8
    tokens = rng.integers(1, VOCAB, size=(n, SEQ))
    lengths = rng.integers(SEQ // 4, SEQ + 1, size=(n,))
    tokens[np.arange(SEQ)[None, :] >= lengths[:, None]] = 0  # padded with zeros, masked
    data = tf.data.Dataset.from_tensor_slices((tokens, rng.integers(0, 10, size=(n,)))).repeat().batch(gb)
    model.fit(data, epochs=1, steps_per_epoch=a.steps, verbose=0, callbacks=[Timer()])
else:
    with strategy.scope():
        trunk = keras.Sequential([keras.Input((128,)), keras.layers.Dense(512, activation="relu"),
                                  keras.layers.Dense(256, activation="relu")])
        head = keras.Sequential([keras.Input((256,)), keras.layers.Dense(10)])
        trunk_opt, head_opt = keras.optimizers.Adam(1e-3), keras.optimizers.SGD(0.05)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    x, y = tf.random.normal((gb * 4, 128)), tf.random.uniform((gb * 4,), maxval=10, dtype=tf.int64)
    data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(gb)

    def replica_step(xb, yb):
        with tf.GradientTape(persistent=True) as tape:
            loss = tf.nn.compute_average_loss(loss_fn(yb, head(trunk(xb, training=True))), global_batch_size=gb)
        trunk_opt.apply_gradients(zip(tape.gradient(loss, trunk.trainable_variables), trunk.trainable_variables))
        head_opt.apply_gradients(zip(tape.gradient(loss, head.trainable_variables), head.trainable_variables))
        del tape
        return loss

    @tf.function
    def step(xb, yb):
        return strategy.reduce("SUM", strategy.run(replica_step, args=(xb, yb)), axis=None)

    batches = iter(strategy.experimental_distribute_dataset(data))
    for _ in range(a.steps):
        start = time.perf_counter()
        step(*next(batches)).numpy()
        times.append(time.perf_counter() - start)
if strategy.cluster_resolver.task_id == 0:
    print(f"median step {statistics.median(times[len(times) // 2:]) * 1000:.3f} ms", flush=True)
