"""TensorFlow shapes of session 42 (MultiWorkerMirroredStrategy, 2 workers): --thread (a custom loop run in a thread
of the script's, the main thread waiting on it), --fit-thread (Keras fit called from such a thread); neither: the same
loop in the main thread, for comparison."""
import argparse, os, statistics, threading, time
p = argparse.ArgumentParser(); p.add_argument("--steps", type=int, default=40)
for flag in ("--thread", "--fit-thread"):
    p.add_argument(flag, action="store_true")
a = p.parse_args()
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1"); os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf
keras = tf.keras
strategy = tf.distribute.MultiWorkerMirroredStrategy()
gb = 32 * strategy.num_replicas_in_sync
chief = strategy.cluster_resolver.task_id == 0
with strategy.scope():
    model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(768, activation="relu"),
                              keras.layers.Dense(768, activation="relu"), keras.layers.Dense(10)])
    opt = keras.optimizers.Adam(1e-3)
n = gb * 4
x, y = tf.random.normal((n, 256)), tf.random.uniform((n,), maxval=10, dtype=tf.int64)
train = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(gb).prefetch(2)
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=keras.losses.Reduction.NONE)
times = []


class Timer(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        self.t = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        times.append(time.perf_counter() - self.t)


def fit() -> None:
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(train, steps_per_epoch=a.steps, epochs=1, verbose=0, callbacks=[Timer()])


def loop() -> None:
    batches = iter(strategy.experimental_distribute_dataset(train))

    @tf.function
    def train_step(xb, yb):
        def fn(xr, yr):
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(loss_fn(yr, model(xr, training=True)), global_batch_size=gb)
            opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
            return loss
        return strategy.run(fn, args=(xb, yb))

    for _ in range(a.steps):
        t = time.perf_counter()
        train_step(*next(batches))
        times.append(time.perf_counter() - t)


if a.thread or a.fit_thread:
    worker = threading.Thread(target=fit if a.fit_thread else loop, name="trainer")
    worker.start()
    worker.join()
else:
    loop()
if chief:
    print(f"median iteration time: {1000 * statistics.median(times[len(times)//2:]):.3f} ms", flush=True)
