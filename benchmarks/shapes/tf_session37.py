"""TensorFlow shapes of session 37 (MultiWorkerMirroredStrategy, 2 workers; tf-keras fit of an MLP with Adam):
--checkpoint (Keras's ModelCheckpoint saving the weights every 10 batches: the chief to the real path, the other
worker to a temporary one, as tf.distribute wants), --backup (BackupAndRestore saving every 10 batches, the
fault-tolerance callback for multi-worker training), --stop-at N (a callback that ends fit at batch N, as
EarlyStopping does: the job stops before the iterations dprorun would profile)."""
import argparse, os, statistics, tempfile, time
p = argparse.ArgumentParser(); p.add_argument("--steps", type=int, default=40)
p.add_argument("--checkpoint", action="store_true"); p.add_argument("--backup", action="store_true")
p.add_argument("--stop-at", type=int, default=0)
a = p.parse_args()
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1"); os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf
keras = tf.keras
strategy = tf.distribute.MultiWorkerMirroredStrategy()
gb = 32 * strategy.num_replicas_in_sync
epochs = 4
with strategy.scope():
    model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(512, activation="relu"),
                              keras.layers.Dense(512, activation="relu"), keras.layers.Dense(4)])
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
n = gb * 4
x, y = tf.random.normal((n, 256)), tf.random.uniform((n,), maxval=4, dtype=tf.int64)
train = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(gb).prefetch(2)
times = []
chief = strategy.cluster_resolver.task_id == 0
where = tempfile.mkdtemp()


class T(keras.callbacks.Callback):
    def on_train_batch_begin(self, b, logs=None): self.t = time.perf_counter()

    def on_train_batch_end(self, b, logs=None):
        times.append(time.perf_counter() - self.t)
        if a.stop_at and len(times) >= a.stop_at:
            self.model.stop_training = True


callbacks = [T()]
if a.checkpoint:
    path = os.path.join(where, "ckpt" if chief else f"ckpt-worker-{strategy.cluster_resolver.task_id}", "w.ckpt")
    callbacks.append(keras.callbacks.ModelCheckpoint(path, save_weights_only=True, save_freq=10))
if a.backup:
    callbacks.append(keras.callbacks.BackupAndRestore(os.path.join(where, "backup"), save_freq=10))
model.fit(train, epochs=epochs, steps_per_epoch=a.steps // epochs, verbose=0, callbacks=callbacks)
if chief:
    print(f"median iteration time: {1000 * statistics.median(times[len(times)//2:]):.3f} ms", flush=True)
