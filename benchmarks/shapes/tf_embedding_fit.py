"""tf-keras fit of a recommender-like model: an Embedding table of 50000 x 64 (IndexedSlices gradients, which
MultiWorkerMirroredStrategy all-gathers), mean-pooled, a dense tower; --mixed: mixed_bfloat16 policy;
--frozen: the embedding frozen (trainable=False)."""
import os, statistics, time, argparse
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1"); os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf
p = argparse.ArgumentParser(); p.add_argument("--steps", type=int, default=40)
p.add_argument("--mixed", action="store_true"); p.add_argument("--frozen", action="store_true"); a = p.parse_args()
if a.mixed:
    tf.keras.mixed_precision.set_global_policy("mixed_bfloat16")
strategy = tf.distribute.MultiWorkerMirroredStrategy()
gb = 64 * strategy.num_replicas_in_sync
with strategy.scope():
    emb = tf.keras.layers.Embedding(50000, 64)
    emb.trainable = not a.frozen
    model = tf.keras.Sequential([tf.keras.Input((20,), dtype=tf.int32), emb,
                                 tf.keras.layers.GlobalAveragePooling1D(),
                                 tf.keras.layers.Dense(512, activation="relu"),
                                 tf.keras.layers.Dense(512, activation="relu"),
                                 tf.keras.layers.Dense(1, dtype="float32")])
    model.compile(optimizer=tf.keras.optimizers.Adagrad(0.01),
                  loss=tf.keras.losses.BinaryCrossentropy(from_logits=True))
x = tf.random.uniform((gb * 8, 20), maxval=50000, dtype=tf.int32)
y = tf.cast(tf.random.uniform((gb * 8, 1)) > 0.5, tf.float32)
train = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(gb)
times = []
class T(tf.keras.callbacks.Callback):
    def on_train_batch_begin(self, b, logs=None): self.t = time.perf_counter()
    def on_train_batch_end(self, b, logs=None): times.append(time.perf_counter() - self.t)
model.fit(train, epochs=1, steps_per_epoch=a.steps, verbose=0, callbacks=[T()])
if strategy.cluster_resolver.task_id == 0:
    print(f"median iteration time: {1000 * statistics.median(times[len(times)//2:]):.3f} ms", flush=True)
