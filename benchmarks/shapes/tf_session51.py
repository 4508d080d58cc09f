"""TensorFlow shapes of session 51 (MultiWorkerMirroredStrategy, 2 workers): --jit-compile (Keras fit of an MLP
compiled with jit_compile=True: XLA clusters the step), --transformer (a token classifier: an Embedding, a
MultiHeadAttention block with LayerNormalization, AdamW under a warm-up LearningRateSchedule of its own)."""
import argparse, os, statistics, time
p = argparse.ArgumentParser(); p.add_argument("--steps", type=int, default=40)
for flag in ("--jit-compile", "--transformer"):
    p.add_argument(flag, action="store_true")
a = p.parse_args()
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1"); os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf
keras = tf.keras
strategy = tf.distribute.MultiWorkerMirroredStrategy()
gb = 16 * strategy.num_replicas_in_sync
n = gb * 4


class WarmUp(keras.optimizers.schedules.LearningRateSchedule):
    def __call__(self, step):
        return 1e-3 * tf.minimum(1.0, tf.cast(step + 1, tf.float32) / 10.0)

    def get_config(self):
        return {}


with strategy.scope():
    if a.transformer:
        ids = keras.Input((32,), dtype="int32")
        h = keras.layers.Embedding(4000, 128)(ids)
        h = keras.layers.LayerNormalization()(h + keras.layers.MultiHeadAttention(4, 32)(h, h))
        h = keras.layers.LayerNormalization()(h + keras.layers.Dense(128)(keras.layers.Dense(256, "gelu")(h)))
        model = keras.Model(ids, keras.layers.Dense(10)(keras.layers.GlobalAveragePooling1D()(h)))
        opt = keras.optimizers.AdamW(WarmUp(), weight_decay=0.01)
    else:
        model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(768, activation="relu"),
                                  keras.layers.Dense(768, activation="relu"), keras.layers.Dense(10)])
        opt = keras.optimizers.SGD(0.01, momentum=0.9)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=a.jit_compile)
labels = tf.random.uniform((n,), maxval=10, dtype=tf.int64)
if a.transformer:
    features = tf.random.uniform((n, 32), maxval=4000, dtype=tf.int32)
else:
    features = tf.random.normal((n, 256))
train = tf.data.Dataset.from_tensor_slices((features, labels)).repeat().batch(gb).prefetch(2)
times = []


class Timer(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        self.t = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        times.append(time.perf_counter() - self.t)


model.fit(train, steps_per_epoch=a.steps, epochs=1, verbose=0, callbacks=[Timer()])
if strategy.cluster_resolver.task_id == 0:
    print(f"median iteration time: {statistics.median(times[len(times)//2:]) * 1000:.3f} ms")
