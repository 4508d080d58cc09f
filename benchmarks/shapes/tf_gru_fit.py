"""tf-keras fit: a GRU sequence classifier with a conv front, SGD momentum, epochs of 2 x steps/2, validation off."""
import os, statistics, time, argparse
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1"); os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf
p = argparse.ArgumentParser(); p.add_argument("--steps", type=int, default=40); a = p.parse_args()
strategy = tf.distribute.MultiWorkerMirroredStrategy()
gb = 32 * strategy.num_replicas_in_sync
with strategy.scope():
    model = tf.keras.Sequential([tf.keras.layers.Embedding(5000, 32), tf.keras.layers.Conv1D(64, 5, activation="relu"),
                                 tf.keras.layers.GRU(64), tf.keras.layers.Dense(128, activation="relu"),
                                 tf.keras.layers.Dense(2)])
    model.compile(optimizer=tf.keras.optimizers.SGD(0.01, momentum=0.9),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
x = tf.random.uniform((gb * 4, 40), maxval=5000, dtype=tf.int64)
y = tf.random.uniform((gb * 4,), maxval=2, dtype=tf.int64)
data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(gb)
times = []
class T(tf.keras.callbacks.Callback):
    def on_train_batch_begin(self, b, logs=None): self.t = time.perf_counter()
    def on_train_batch_end(self, b, logs=None): times.append(time.perf_counter() - self.t)
model.fit(data, epochs=2, steps_per_epoch=a.steps // 2, verbose=0, callbacks=[T()])
if strategy.cluster_resolver.task_id == 0:
    print(f"median iteration time: {1000 * statistics.median(times[len(times)//2:]):.3f} ms", flush=True)
