"""tf-keras fit of a small conv net with validation_data after every epoch, Adam, a ReduceLROnPlateau callback
and a learning-rate schedule: epochs of --steps/4 steps, 4 epochs (--after: validation every second epoch, then
model.evaluate and model.predict after the fit)."""
import os, statistics, time, argparse
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1"); os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf
p = argparse.ArgumentParser(); p.add_argument("--steps", type=int, default=40)
p.add_argument("--after", action="store_true"); a = p.parse_args()
strategy = tf.distribute.MultiWorkerMirroredStrategy()
gb = 16 * strategy.num_replicas_in_sync
with strategy.scope():
    model = tf.keras.Sequential([tf.keras.Input((32, 32, 3)), tf.keras.layers.Conv2D(16, 3, activation="relu"),
                                 tf.keras.layers.Conv2D(32, 3, activation="relu"),
                                 tf.keras.layers.GlobalAveragePooling2D(),
                                 tf.keras.layers.Dense(256, activation="relu"), tf.keras.layers.Dense(10)])
    schedule = tf.keras.optimizers.schedules.ExponentialDecay(1e-3, decay_steps=10, decay_rate=0.9)
    model.compile(optimizer=tf.keras.optimizers.Adam(schedule),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
x = tf.random.normal((gb * 4, 32, 32, 3)); y = tf.random.uniform((gb * 4,), maxval=10, dtype=tf.int64)
train = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(gb)
val = tf.data.Dataset.from_tensor_slices((x, y)).batch(gb)
times = []
class T(tf.keras.callbacks.Callback):
    def on_train_batch_begin(self, b, logs=None): self.t = time.perf_counter()
    def on_train_batch_end(self, b, logs=None): times.append(time.perf_counter() - self.t)
model.fit(train, epochs=4, steps_per_epoch=a.steps // 4, validation_data=val, verbose=0,
          validation_freq=2 if a.after else 1, callbacks=[T(), tf.keras.callbacks.ReduceLROnPlateau(patience=1)])
if a.after:
    model.evaluate(val, verbose=0)
    model.predict(val, verbose=0)
if strategy.cluster_resolver.task_id == 0:
    print(f"median iteration time: {1000 * statistics.median(times[len(times)//2:]):.3f} ms", flush=True)
