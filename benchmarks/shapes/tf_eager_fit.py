"""tf-keras fit with run_eagerly=True under MultiWorkerMirroredStrategy (session 39): its steps run eagerly. Run with
`dprorun --backend tf -np 2 python benchmarks/shapes/tf_eager_fit.py`."""
import os, statistics, time
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1"); os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf
keras = tf.keras
strategy = tf.distribute.MultiWorkerMirroredStrategy()
gb = 32 * strategy.num_replicas_in_sync
with strategy.scope():
    model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(512, activation="relu"), keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), run_eagerly=True)
x, y = tf.random.normal((gb * 4, 256)), tf.random.uniform((gb * 4,), maxval=10, dtype=tf.int64)
times = []
class T(keras.callbacks.Callback):
    def on_train_batch_begin(self, b, logs=None): self.t = time.perf_counter()
    def on_train_batch_end(self, b, logs=None): times.append(time.perf_counter() - self.t)
model.fit(tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(gb), epochs=1, steps_per_epoch=40, verbose=0,
          callbacks=[T()])
if strategy.cluster_resolver.task_id == 0:
    print(f"median iteration time: {1000 * statistics.median(times[20:]):.3f} ms", flush=True)
