"""TensorFlow shapes of session 37 (MultiWorkerMirroredStrategy, 2 workers; tf-keras fit of an MLP with Adam):
--checkpoint (Keras's ModelCheckpoint saving the weights every 10 batches: the chief to the real path, the other
worker to a temporary one, as tf.distribute wants), --backup (BackupAndRestore saving every 10 batches, the
fault-tolerance callback for multi-worker training), --stop-at N (a callback that ends fit at batch N, as
EarlyStopping does: the job stops before the iterations dprorun would profile), --partial (a custom loop over 4
epochs of a distributed dataset whose last batch is partial, no drop_remainder: the step function is traced again
for that batch's shape in the first epoch)."""
import argparse, os, statistics, tempfile, time
p = argparse.ArgumentParser(); p.add_argument("--steps", type=int, default=40)
p.add_argument("--checkpoint", action="store_true"); p.add_argument("--backup", action="store_true")
p.add_argument("--stop-at", type=int, default=0); p.add_argument("--partial", action="store_true")
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
if a.partial:
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=keras.losses.Reduction.NONE)
    per_epoch = a.steps // epochs  # full global batches an epoch, then one of a third of a batch
    samples = gb * per_epoch - 2 * gb // 3
    data = tf.data.Dataset.from_tensor_slices((tf.random.normal((samples, 256)),
                                               tf.random.uniform((samples,), maxval=4, dtype=tf.int64))).batch(gb)
    dist_data = strategy.experimental_distribute_dataset(data)
    opt = model.optimizer

    @tf.function
    def train_step(xb, yb):
        def fn(xr, yr):
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(loss_fn(yr, model(xr, training=True)), global_batch_size=gb)
            opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
            return loss
        return strategy.reduce("SUM", strategy.run(fn, args=(xb, yb)), axis=None)

    for _ in range(epochs):
        for xb, yb in dist_data:
            t = time.perf_counter()
            train_step(xb, yb)
            times.append(time.perf_counter() - t)
else:
    model.fit(train, epochs=epochs, steps_per_epoch=a.steps // epochs, verbose=0, callbacks=callbacks)
if chief:
    print(f"median iteration time: {1000 * statistics.median(times[len(times)//2:]):.3f} ms", flush=True)
