"""tf-keras fit with steps_per_execution=4 (Keras runs 4 training steps inside one tf.function call, the callbacks
seeing one batch per call): an MLP over 256-wide features, SGD with momentum, --steps steps in one epoch."""
import os, statistics, time, argparse
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1"); os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf
p = argparse.ArgumentParser(); p.add_argument("--steps", type=int, default=40)
p.add_argument("--per-execution", type=int, default=4); a = p.parse_args()
strategy = tf.distribute.MultiWorkerMirroredStrategy()
gb = 32 * strategy.num_replicas_in_sync
with strategy.scope():
    model = tf.keras.Sequential([tf.keras.Input((256,)), tf.keras.layers.Dense(1024, activation="relu"),
                                 tf.keras.layers.Dense(1024, activation="relu"), tf.keras.layers.Dense(10)])
    model.compile(optimizer=tf.keras.optimizers.SGD(0.01, momentum=0.9), steps_per_execution=a.per_execution,
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
x = tf.random.normal((gb * 8, 256)); y = tf.random.uniform((gb * 8,), maxval=10, dtype=tf.int64)
train = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(gb)
times = []
class T(tf.keras.callbacks.Callback):
    def on_train_batch_begin(self, b, logs=None): self.t = time.perf_counter()
    def on_train_batch_end(self, b, logs=None): times.append(time.perf_counter() - self.t)
model.fit(train, epochs=1, steps_per_epoch=a.steps * a.per_execution, verbose=0, callbacks=[T()])
if strategy.cluster_resolver.task_id == 0:  # one callback batch per execution: per training step
    print(f"median iteration time: {1000 * statistics.median(times[len(times)//2:]) / a.per_execution:.3f} ms",
          flush=True)
