"""TensorFlow shapes of session 36 (MultiWorkerMirroredStrategy, 2 workers): --tensorboard (tf-keras fit of an MLP
with Keras's TensorBoard callback: scalars every batch, weight histograms each epoch, its own profile of batches
12-14, --tb-profile), --two-inputs (a functional model of two inputs, an embedding and dense features, with class
weights and SGD with Nesterov momentum), --mixed16 (the MLP fit under the mixed_float16 policy: Keras wraps its
optimizer in a LossScaleOptimizer), --numpy (the MLP fit on NumPy arrays with batch_size, no tf.data), --loop (a
custom loop over strategy.experimental_distribute_dataset: a tf.function taking the distributed iterator, next()
inside it, the loss reduced with strategy.reduce), --xla (compile(jit_compile=True): XLA compiles the step). (Keras 3's fit fails under this strategy upstream: tf_keras.)"""
import argparse, os, statistics, tempfile, time
p = argparse.ArgumentParser(); p.add_argument("--steps", type=int, default=40)
for f in ("tensorboard", "two-inputs", "mixed16", "numpy", "loop", "xla"): p.add_argument("--" + f, action="store_true")
p.add_argument("--tb-profile", default="12,14", help="the TensorBoard callback's profile_batch")
a = p.parse_args()
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1"); os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf
keras = tf.keras
if a.mixed16:
    keras.mixed_precision.set_global_policy("mixed_float16")
strategy = tf.distribute.MultiWorkerMirroredStrategy()
gb = 32 * strategy.num_replicas_in_sync
epochs = 4
with strategy.scope():
    if a.two_inputs:
        ids = keras.Input((8,), dtype="int32"); dense = keras.Input((64,))
        e = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(2000, 64)(ids))
        h = keras.layers.Dense(256, activation="relu")(keras.layers.Concatenate()([e, dense]))
        model = keras.Model([ids, dense], keras.layers.Dense(4)(h))
        opt = keras.optimizers.SGD(0.01, momentum=0.9, nesterov=True)
    else:
        model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(512, activation="relu"),
                                  keras.layers.Dense(512, activation="relu"), keras.layers.Dense(4),
                                  keras.layers.Activation("linear", dtype="float32")])
        opt = keras.optimizers.Adam(1e-3)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=a.xla)
n = gb * 4
y = tf.random.uniform((n,), maxval=4, dtype=tf.int64)
if a.two_inputs:
    x = (tf.random.uniform((n, 8), maxval=2000, dtype=tf.int32), tf.random.normal((n, 64)))
else:
    x = tf.random.normal((n, 256))
train = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(gb).prefetch(2)
times = []


class T(keras.callbacks.Callback):
    def on_train_batch_begin(self, b, logs=None): self.t = time.perf_counter()
    def on_train_batch_end(self, b, logs=None): times.append(time.perf_counter() - self.t)


callbacks = [T()]
if a.tensorboard:
    callbacks.append(keras.callbacks.TensorBoard(os.path.join(tempfile.mkdtemp(), "tb"), histogram_freq=1,
                                                 update_freq="batch",
                                                 profile_batch=tuple(int(b) for b in a.tb_profile.split(","))))
if a.loop:
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=keras.losses.Reduction.NONE)
    iterator = iter(strategy.experimental_distribute_dataset(train))

    @tf.function
    def train_step(it):
        def fn(inputs):
            xb, yb = inputs
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(loss_fn(yb, model(xb, training=True)), global_batch_size=gb)
            opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
            return loss
        return strategy.reduce("SUM", strategy.run(fn, args=(next(it),)), axis=None)

    for _ in range(a.steps):
        t = time.perf_counter()
        train_step(iterator)
        times.append(time.perf_counter() - t)
elif a.numpy:
    model.fit(x.numpy(), y.numpy(), batch_size=gb, epochs=a.steps // 4, verbose=0, callbacks=callbacks)
else:
    model.fit(train, epochs=epochs, steps_per_epoch=a.steps // epochs, verbose=0, callbacks=callbacks,
              class_weight={0: 1.0, 1: 2.0, 2: 1.0, 3: 0.5} if a.two_inputs else None)
if strategy.cluster_resolver.task_id == 0:
    print(f"median iteration time: {1000 * statistics.median(times[len(times)//2:]):.3f} ms", flush=True)
