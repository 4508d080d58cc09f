"""TensorFlow shapes of session 44 (MultiWorkerMirroredStrategy, 2 workers): --global-clipnorm (Keras fit with
Adam(global_clipnorm=1.0): the gradients all-reduced, then clipped by their global norm), --sample-weight (fit over
a dataset of (x, y, sample_weight) triples, a weighted loss, a Dropout layer), --functional-two-inputs (a functional
model of two inputs, an Embedding and dense features, concatenated; SGD with Nesterov momentum)."""
import argparse, os, statistics, time
p = argparse.ArgumentParser(); p.add_argument("--steps", type=int, default=40)
for flag in ("--global-clipnorm", "--sample-weight", "--functional-two-inputs"):
    p.add_argument(flag, action="store_true")
a = p.parse_args()
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1"); os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf
keras = tf.keras
strategy = tf.distribute.MultiWorkerMirroredStrategy()
gb = 32 * strategy.num_replicas_in_sync
n = gb * 4
with strategy.scope():
    if a.functional_two_inputs:
        ids, dense = keras.Input((8,), dtype="int32"), keras.Input((64,))
        pooled = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(5000, 64)(ids))
        hidden = keras.layers.Dense(512, activation="relu")(keras.layers.Concatenate()([pooled, dense]))
        model = keras.Model([ids, dense], keras.layers.Dense(10)(hidden))
        opt = keras.optimizers.SGD(0.01, momentum=0.9, nesterov=True)
    else:
        model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(768, activation="relu"),
                                  keras.layers.Dropout(0.1), keras.layers.Dense(768, activation="relu"),
                                  keras.layers.Dense(10)])
        opt = keras.optimizers.Adam(1e-3, global_clipnorm=1.0 if a.global_clipnorm else None)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
labels = tf.random.uniform((n,), maxval=10, dtype=tf.int64)
if a.functional_two_inputs:
    features = (tf.random.uniform((n, 8), maxval=5000, dtype=tf.int32), tf.random.normal((n, 64)))
    train = tf.data.Dataset.from_tensor_slices((features, labels))
elif a.sample_weight:
    train = tf.data.Dataset.from_tensor_slices((tf.random.normal((n, 256)), labels, tf.random.uniform((n,))))
else:
    train = tf.data.Dataset.from_tensor_slices((tf.random.normal((n, 256)), labels))
train = train.repeat().batch(gb).prefetch(2)
times = []


class Timer(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        self.t = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        times.append(time.perf_counter() - self.t)


model.fit(train, steps_per_epoch=a.steps, epochs=1, verbose=0, callbacks=[Timer()])
if strategy.cluster_resolver.task_id == 0:
    print(f"median iteration time: {statistics.median(times[len(times)//2:]) * 1000:.3f} ms")
