"""TensorFlow shapes of session 52 (MultiWorkerMirroredStrategy, 2 workers): --ema (Keras fit of an MLP whose Adam
keeps an exponential moving average of the weights, use_ema=True, copied into the weights every 10 steps),
--lookahead-loop (a custom loop of a step tf.function of its own that applies the gradients and then, every 5th
step, pulls the fast weights toward slow copies kept in variables of its own: Lookahead written by hand);
--inference-mode-loop (the same loop without Lookahead, its model called with training=False inside the tape:
trained in inference mode, as fine-tuning with BatchNormalization's statistics fixed does)."""
import argparse, os, statistics, time
p = argparse.ArgumentParser(); p.add_argument("--steps", type=int, default=40)
for flag in ("--ema", "--lookahead-loop", "--inference-mode-loop"):
    p.add_argument(flag, action="store_true")
a = p.parse_args()
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1"); os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf
keras = tf.keras
strategy = tf.distribute.MultiWorkerMirroredStrategy()
gb = 32 * strategy.num_replicas_in_sync
n = gb * 4
with strategy.scope():
    model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(768, activation="relu"),
                              keras.layers.Dense(768, activation="relu"), keras.layers.Dense(10)])
    if a.ema:
        opt = keras.optimizers.Adam(1e-3, use_ema=True, ema_momentum=0.99, ema_overwrite_frequency=10)
    else:
        opt = keras.optimizers.SGD(0.05, momentum=0.9)
        slow = [tf.Variable(v, trainable=False) for v in model.trainable_variables]
        counter = tf.Variable(0, dtype=tf.int64, trainable=False)
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
features, labels = tf.random.normal((n, 256)), tf.random.uniform((n,), maxval=10, dtype=tf.int64)
train = tf.data.Dataset.from_tensor_slices((features, labels)).repeat().batch(gb).prefetch(2)
times = []
if a.ema:
    class Timer(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.t = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            times.append(time.perf_counter() - self.t)

    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(train, steps_per_epoch=a.steps, epochs=1, verbose=0, callbacks=[Timer()])
else:
    def replica_step(x, y):
        with tf.GradientTape() as tape:
            out = model(x, training=not a.inference_mode_loop)
            loss = tf.nn.compute_average_loss(loss_fn(y, out), global_batch_size=gb)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        counter.assign_add(1)
        if a.lookahead_loop and counter % 5 == 0:  # Lookahead: slow <- slow + 0.5 (fast - slow); fast <- slow
            for fast, kept in zip(model.trainable_variables, slow):
                kept.assign_add(0.5 * (fast - kept))
                fast.assign(kept)
        return loss

    @tf.function
    def step(x, y):
        losses = strategy.run(replica_step, args=(x, y))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    batches = iter(strategy.experimental_distribute_dataset(train))
    for _ in range(a.steps):
        start = time.perf_counter()
        x, y = next(batches)
        step(x, y).numpy()
        times.append(time.perf_counter() - start)
if strategy.cluster_resolver.task_id == 0:
    print(f"median iteration time: {statistics.median(times[len(times)//2:]) * 1000:.3f} ms")
