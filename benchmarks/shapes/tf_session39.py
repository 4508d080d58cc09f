"""TensorFlow shapes of session 39 (MultiWorkerMirroredStrategy, 2 workers, custom loops):
--accumulate-2 (a step runs two micro-batches through the tape, sums their gradients and applies them once: one
all-reduce of the gradients a step, two forwards and backwards), --two-optimizers (Adam for the body, SGD with
momentum for the head: two apply_gradients a step, each all-reducing its own variables)."""
import argparse, os, statistics, time
p = argparse.ArgumentParser(); p.add_argument("--steps", type=int, default=40)
for flag in ("--accumulate-2", "--two-optimizers"):
    p.add_argument(flag, action="store_true")
a = p.parse_args()
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1"); os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf
keras = tf.keras
strategy = tf.distribute.MultiWorkerMirroredStrategy()
gb = 32 * strategy.num_replicas_in_sync
chief = strategy.cluster_resolver.task_id == 0
with strategy.scope():
    body = keras.Sequential([keras.Input((256,)), keras.layers.Dense(768, activation="relu"),
                             keras.layers.Dense(768, activation="relu")])
    head = keras.Sequential([keras.Input((768,)), keras.layers.Dense(10)])
    body_opt = keras.optimizers.Adam(1e-3)
    head_opt = keras.optimizers.SGD(0.01, momentum=0.9) if a.two_optimizers else body_opt
n = gb * 4
x, y = tf.random.normal((n, 256)), tf.random.uniform((n,), maxval=10, dtype=tf.int64)
train = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(gb).prefetch(2)
batches = iter(strategy.experimental_distribute_dataset(train))
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=keras.losses.Reduction.NONE)
variables = body.trainable_variables + head.trainable_variables


def grads_of(xr, yr):
    with tf.GradientTape() as tape:
        loss = tf.nn.compute_average_loss(loss_fn(yr, head(body(xr, training=True))), global_batch_size=gb)
    return loss, tape.gradient(loss, variables)


@tf.function
def train_step(xb, yb):
    def fn(xr, yr):
        if a.accumulate_2:
            half = tf.shape(xr)[0] // 2
            loss, grads = grads_of(xr[:half], yr[:half])
            loss2, grads2 = grads_of(xr[half:], yr[half:])
            loss, grads = loss + loss2, [g + g2 for g, g2 in zip(grads, grads2)]
        else:
            loss, grads = grads_of(xr, yr)
        split = len(body.trainable_variables)
        if a.two_optimizers:
            body_opt.apply_gradients(zip(grads[:split], variables[:split]))
            head_opt.apply_gradients(zip(grads[split:], variables[split:]))
        else:
            body_opt.apply_gradients(zip(grads, variables))
        return loss
    return strategy.run(fn, args=(xb, yb))


times = []
for _ in range(a.steps):
    t = time.perf_counter()
    train_step(*next(batches))
    times.append(time.perf_counter() - t)
if chief:
    print(f"median iteration time: {1000 * statistics.median(times[len(times)//2:]):.3f} ms", flush=True)
