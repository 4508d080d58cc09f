"""TensorFlow shapes of session 65 (MultiWorkerMirroredStrategy, 2 workers): --train-step-two-optimizers (tf-keras
fit of a Model subclass whose own train_step applies the encoder's gradients with Adam and the classifier's with
SGD), --loss-scale-loop (a custom loop under mixed_float16 with a LossScaleOptimizer: scaled loss, unscaled
gradients, a step skipped on overflow), --embedding-two-optimizers (a custom loop applying an Embedding's sparse
gradients with Adagrad and the dense layers' with Adam, and reducing its loss after the step),
--gather-contrastive (a custom loop whose InfoNCE loss all-gathers the second views' embeddings from every replica,
gradients through the gather).
Tried and dropped as shapes no plain launch runs: gradients accumulated in a train_step and applied inside a tf.cond
(TensorFlow: "merge_call called while defining a new graph"), tf-keras fit with jit_compile=True ("Collectives are
not yet implemented for CPU devices when compiling with XLA")."""
import argparse, os, statistics, time
p = argparse.ArgumentParser(); p.add_argument("--steps", type=int, default=40)
for flag in ("--train-step-two-optimizers", "--loss-scale-loop", "--embedding-two-optimizers",
             "--gather-contrastive"):
    p.add_argument(flag, action="store_true")
a = p.parse_args()
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np
import tensorflow as tf
keras = tf.keras
strategy = tf.distribute.MultiWorkerMirroredStrategy()
per_replica = 32
gb = per_replica * strategy.num_replicas_in_sync
times = []


class Timer(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        self.start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        times.append(time.perf_counter() - self.start)


def timed_loop(replica_step, data):
    """A custom loop: a tf.function running `replica_step` on every replica, the loss summed after it."""
    @tf.function
    def step(xb, yb):
        return strategy.reduce("SUM", strategy.run(replica_step, args=(xb, yb)), axis=None)

    batches = iter(strategy.experimental_distribute_dataset(data))
    for _ in range(a.steps):
        start = time.perf_counter()
        step(*next(batches)).numpy()
        times.append(time.perf_counter() - start)


if a.gather_contrastive:
    with strategy.scope():
        encoder = keras.Sequential([keras.Input((128,)), keras.layers.Dense(512, activation="relu"),
                                    keras.layers.Dense(128)])
        opt = keras.optimizers.Adam(1e-3)
    views = tf.random.normal((gb * 4, 2, 128))
    data = tf.data.Dataset.from_tensor_slices((views, tf.zeros((gb * 4,), tf.int64))).repeat().batch(gb)

    def replica_step(vb, _):
        ctx = tf.distribute.get_replica_context()
        with tf.GradientTape() as tape:
            z1 = tf.math.l2_normalize(encoder(vb[:, 0], training=True), axis=1)
            z2 = tf.math.l2_normalize(encoder(vb[:, 0] + 0.1 * vb[:, 1], training=True), axis=1)
            all_z2 = ctx.all_gather(z2, axis=0)  # every replica's second views: the negatives
            logits = tf.matmul(z1, all_z2, transpose_b=True) / 0.1
            labels = tf.range(tf.shape(z1)[0], dtype=tf.int64) + tf.cast(ctx.replica_id_in_sync_group, tf.int64) \
                * tf.cast(tf.shape(z1)[0], tf.int64)
            loss = tf.nn.compute_average_loss(
                tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits), global_batch_size=gb)
        opt.apply_gradients(zip(tape.gradient(loss, encoder.trainable_variables), encoder.trainable_variables))
        return loss

    timed_loop(replica_step, data)
elif a.train_step_two_optimizers:
    class TwoOptimizers(keras.Model):
        def __init__(self):
            super().__init__()
            self.encoder = keras.Sequential([keras.layers.Dense(512, activation="relu"),
                                             keras.layers.Dense(256, activation="relu")])
            self.classifier = keras.layers.Dense(10)

        def call(self, x, training=False):
            return self.classifier(self.encoder(x, training=training))

        def compile(self, encoder_opt, classifier_opt, loss):
            super().compile()
            self.encoder_opt, self.classifier_opt, self.loss_fn = encoder_opt, classifier_opt, loss

        def train_step(self, data):
            x, y = data
            with tf.GradientTape(persistent=True) as tape:
                loss = tf.nn.compute_average_loss(self.loss_fn(y, self(x, training=True)), global_batch_size=gb)
            self.encoder_opt.apply_gradients(zip(tape.gradient(loss, self.encoder.trainable_variables),
                                                 self.encoder.trainable_variables))
            self.classifier_opt.apply_gradients(zip(tape.gradient(loss, self.classifier.trainable_variables),
                                                    self.classifier.trainable_variables))
            return {"loss": loss}

    with strategy.scope():
        model = TwoOptimizers()
        model.build((None, 128))
        model.compile(keras.optimizers.Adam(1e-3), keras.optimizers.SGD(0.05),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none"))
    rng = np.random.default_rng(0)
    n = gb * 8
    data = tf.data.Dataset.from_tensor_slices((rng.normal(size=(n, 128)).astype("float32"),
                                               rng.integers(0, 10, size=(n,)))).repeat().batch(gb)
    model.fit(data, epochs=1, steps_per_epoch=a.steps, verbose=0, callbacks=[Timer()])
elif a.loss_scale_loop:
    keras.mixed_precision.set_global_policy("mixed_float16")
    with strategy.scope():
        model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(1024, activation="relu"),
                                  keras.layers.Dense(512, activation="relu"),
                                  keras.layers.Dense(10, dtype="float32")])
        opt = keras.mixed_precision.LossScaleOptimizer(keras.optimizers.SGD(0.05, momentum=0.9))
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    x, y = tf.random.normal((gb * 4, 256)), tf.random.uniform((gb * 4,), maxval=10, dtype=tf.int64)
    data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(gb)

    def replica_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(loss_fn(yb, model(xb, training=True)), global_batch_size=gb)
            scaled = opt.get_scaled_loss(loss)
        grads = opt.get_unscaled_gradients(tape.gradient(scaled, model.trainable_variables))
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    timed_loop(replica_step, data)
else:
    VOCAB, SEQ = 5000, 16
    with strategy.scope():
        embedding = keras.layers.Embedding(VOCAB, 64)
        dense = keras.Sequential([keras.Input((SEQ * 64,)), keras.layers.Dense(256, activation="relu"),
                                  keras.layers.Dense(10)])
        sparse_opt, dense_opt = keras.optimizers.Adagrad(0.05), keras.optimizers.Adam(1e-3)
        embedding.build((None, SEQ))
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    tokens = tf.random.uniform((gb * 4, SEQ), maxval=VOCAB, dtype=tf.int64)
    labels = tf.random.uniform((gb * 4,), maxval=10, dtype=tf.int64)
    data = tf.data.Dataset.from_tensor_slices((tokens, labels)).repeat().batch(gb)

    def replica_step(tb, yb):
        with tf.GradientTape(persistent=True) as tape:
            logits = dense(tf.reshape(embedding(tb), (-1, SEQ * 64)), training=True)
            loss = tf.nn.compute_average_loss(loss_fn(yb, logits), global_batch_size=gb)
        sparse_opt.apply_gradients(zip(tape.gradient(loss, embedding.trainable_variables),
                                       embedding.trainable_variables))
        dense_opt.apply_gradients(zip(tape.gradient(loss, dense.trainable_variables), dense.trainable_variables))
        return loss

    timed_loop(replica_step, data)
if strategy.cluster_resolver.task_id == 0:
    print(f"median step {statistics.median(times[len(times) // 2:]) * 1000:.3f} ms", flush=True)
