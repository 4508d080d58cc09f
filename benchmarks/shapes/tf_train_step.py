"""tf-keras fit of a subclassed model whose train_step is the script's own (a GradientTape, gradients clipped by
their global norm, apply_gradients), two outputs with weighted losses (--two-heads), epochs of --steps/2 steps."""
import os, statistics, time, argparse
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1"); os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf
p = argparse.ArgumentParser(); p.add_argument("--steps", type=int, default=40); a = p.parse_args()
strategy = tf.distribute.MultiWorkerMirroredStrategy()
gb = 32 * strategy.num_replicas_in_sync


class TwoHeads(tf.keras.Model):
    def __init__(self):
        super().__init__()
        self.trunk = tf.keras.Sequential([tf.keras.layers.Dense(512, activation="relu"),
                                          tf.keras.layers.Dense(512, activation="relu")])
        self.cls, self.reg = tf.keras.layers.Dense(10), tf.keras.layers.Dense(1)
        self.ce = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                                reduction=tf.keras.losses.Reduction.NONE)

    def call(self, x):
        h = self.trunk(x)
        return self.cls(h), self.reg(h)

    def train_step(self, data):
        x, (label, target) = data
        with tf.GradientTape() as tape:
            logits, value = self(x, training=True)
            per_example = self.ce(label, logits) + 0.5 * tf.reduce_mean(tf.square(value - target), axis=-1)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=gb)
        grads = tape.gradient(loss, self.trainable_variables)
        grads, _ = tf.clip_by_global_norm(grads, 1.0)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"loss": loss}


with strategy.scope():
    model = TwoHeads()
    model.compile(optimizer=tf.keras.optimizers.Adam(1e-3))
x = tf.random.normal((gb * 4, 256)); y = tf.random.uniform((gb * 4,), maxval=10, dtype=tf.int64)
t = tf.random.normal((gb * 4, 1))
train = tf.data.Dataset.from_tensor_slices((x, (y, t))).repeat().batch(gb)
times = []
class T(tf.keras.callbacks.Callback):
    def on_train_batch_begin(self, b, logs=None): self.t = time.perf_counter()
    def on_train_batch_end(self, b, logs=None): times.append(time.perf_counter() - self.t)
model.fit(train, epochs=2, steps_per_epoch=a.steps // 2, verbose=0, callbacks=[T()])
if strategy.cluster_resolver.task_id == 0:
    print(f"median iteration time: {1000 * statistics.median(times[len(times)//2:]):.3f} ms", flush=True)
