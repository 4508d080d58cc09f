"""TensorFlow shapes of session 38 (MultiWorkerMirroredStrategy, 2 workers):
--sync-bn (tf-keras fit of a conv net with synchronized BatchNormalization: each BN layer all-reduces its batch
statistics across the workers in the forward), --own-packs (a custom loop under a strategy the script made with
CommunicationOptions(bytes_per_pack=256 KiB, RING)), --aggregate-by-hand (a custom loop that all-reduces the
gradients itself through the replica context, clips the aggregate by its global norm and applies it with
experimental_aggregate_gradients=False)."""
import argparse, os, statistics, time
p = argparse.ArgumentParser(); p.add_argument("--steps", type=int, default=40)
for flag in ("--sync-bn", "--own-packs", "--aggregate-by-hand"):
    p.add_argument(flag, action="store_true")
a = p.parse_args()
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1"); os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf
keras = tf.keras
options = None
if a.own_packs:
    options = tf.distribute.experimental.CommunicationOptions(
        bytes_per_pack=256 * 1024, implementation=tf.distribute.experimental.CommunicationImplementation.RING)
strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
gb = 32 * strategy.num_replicas_in_sync
chief = strategy.cluster_resolver.task_id == 0
times = []
with strategy.scope():
    if a.sync_bn:
        model = keras.Sequential([keras.Input((16, 16, 3)), keras.layers.Conv2D(32, 3, padding="same"),
                                  keras.layers.BatchNormalization(synchronized=True), keras.layers.ReLU(),
                                  keras.layers.Conv2D(32, 3, padding="same"),
                                  keras.layers.BatchNormalization(synchronized=True), keras.layers.ReLU(),
                                  keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)])
        shape = (16, 16, 3)
    else:
        model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(512, activation="relu"),
                                  keras.layers.Dense(512, activation="relu"), keras.layers.Dense(10)])
        shape = (256,)
    opt = keras.optimizers.SGD(0.01, momentum=0.9)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
n = gb * 4
x, y = tf.random.normal((n,) + shape), tf.random.uniform((n,), maxval=10, dtype=tf.int64)
train = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(gb).prefetch(2)


class T(keras.callbacks.Callback):
    def on_train_batch_begin(self, b, logs=None): self.t = time.perf_counter()

    def on_train_batch_end(self, b, logs=None): times.append(time.perf_counter() - self.t)


if a.sync_bn:
    model.fit(train, epochs=2, steps_per_epoch=a.steps // 2, verbose=0, callbacks=[T()])
else:
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=keras.losses.Reduction.NONE)
    batches = iter(strategy.experimental_distribute_dataset(train))

    @tf.function
    def train_step(xb, yb):
        def fn(xr, yr):
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(loss_fn(yr, model(xr, training=True)), global_batch_size=gb)
            grads = tape.gradient(loss, model.trainable_variables)
            if a.aggregate_by_hand:
                grads = tf.distribute.get_replica_context().all_reduce("sum", grads)
                grads, _ = tf.clip_by_global_norm(grads, 1.0)
                opt.apply_gradients(zip(grads, model.trainable_variables), experimental_aggregate_gradients=False)
            else:
                opt.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        return strategy.run(fn, args=(xb, yb))

    for _ in range(a.steps):
        t = time.perf_counter()
        train_step(*next(batches))
        times.append(time.perf_counter() - t)
if chief:
    print(f"median iteration time: {1000 * statistics.median(times[len(times)//2:]):.3f} ms", flush=True)
