"""horovod.tensorflow.keras as Horovod's Keras examples train: fit over 4 epochs of 10 steps (an MLP, SGD with
momentum wrapped in hvd.DistributedOptimizer), with BroadcastGlobalVariablesCallback, MetricAverageCallback (the
epoch's metrics all-reduced at its end, outside the step function) and LearningRateWarmupCallback (the learning
rate set before every batch of the first epoch). Rank 0 prints the median step time of the second half."""
import argparse, os, statistics, time
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2"); os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
import horovod.tensorflow.keras as hvd  # noqa: E402
import tensorflow as tf  # noqa: E402
p = argparse.ArgumentParser(); p.add_argument("--steps", type=int, default=40)
a = p.parse_args()
hvd.init(); tf.random.set_seed(hvd.rank())
epochs, per_epoch, batch = 4, a.steps // 4, 64
model = tf.keras.Sequential([tf.keras.layers.Input((256,)), tf.keras.layers.Dense(512, activation="relu"),
                             tf.keras.layers.Dense(512, activation="relu"), tf.keras.layers.Dense(10)])
lr = 0.01 * hvd.size()
model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(lr, momentum=0.9)), metrics=["accuracy"],
              loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
x = tf.random.normal((batch * per_epoch, 256)); y = tf.random.uniform((batch * per_epoch,), 0, 10, dtype=tf.int32)
times = []


class T(tf.keras.callbacks.Callback):
    def on_train_batch_begin(self, b, logs=None): self.t = time.perf_counter()
    def on_train_batch_end(self, b, logs=None): times.append(time.perf_counter() - self.t)


model.fit(x, y, batch_size=batch, epochs=epochs, verbose=0, shuffle=False,
          callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback(),
                     hvd.callbacks.LearningRateWarmupCallback(initial_lr=lr, warmup_epochs=1,
                                                              steps_per_epoch=per_epoch), T()])
if hvd.rank() == 0:
    print(f"median iteration time: {statistics.median(times[len(times)//2:]) * 1000:.3f} ms")
