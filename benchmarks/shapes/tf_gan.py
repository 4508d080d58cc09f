"""A TensorFlow GAN trained by a custom loop under MultiWorkerMirroredStrategy whose step calls two tf.functions,
each of which trains and all-reduces: the discriminator's (--n-critic of them a step, as WGAN critics take), then
the generator's. The script times its whole step (all the calls) and worker 0 prints the median of the second half.
    dprorun --backend tf -np 2 python benchmarks/shapes/tf_gan.py [--n-critic 2]"""
import argparse, os, statistics, time
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1"); os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf
p = argparse.ArgumentParser(); p.add_argument("--steps", type=int, default=40)
p.add_argument("--n-critic", type=int, default=1); a = p.parse_args()
strategy = tf.distribute.MultiWorkerMirroredStrategy()
batch = 32
gb = batch * strategy.num_replicas_in_sync
with strategy.scope():
    gen = tf.keras.Sequential([tf.keras.Input((64,)), tf.keras.layers.Dense(256, activation="relu"),
                               tf.keras.layers.Dense(512, activation="relu"), tf.keras.layers.Dense(784)])
    disc = tf.keras.Sequential([tf.keras.Input((784,)), tf.keras.layers.Dense(512, activation="relu"),
                                tf.keras.layers.Dense(256, activation="relu"), tf.keras.layers.Dense(1)])
    g_opt, d_opt = tf.keras.optimizers.Adam(2e-4), tf.keras.optimizers.Adam(2e-4)
bce = tf.keras.losses.BinaryCrossentropy(from_logits=True, reduction=tf.keras.losses.Reduction.NONE)
real = tf.random.normal((batch, 784))


@tf.function
def d_step(x):
    def fn(x):
        z = tf.random.normal((batch, 64))
        with tf.GradientTape() as tape:
            fake = gen(z, training=True)
            losses = bce(tf.ones((batch, 1)), disc(x, training=True)) + bce(tf.zeros((batch, 1)),
                                                                             disc(fake, training=True))
            loss = tf.nn.compute_average_loss(losses, global_batch_size=gb)
        d_opt.apply_gradients(zip(tape.gradient(loss, disc.trainable_variables), disc.trainable_variables))
        return loss
    return strategy.run(fn, args=(x,))


@tf.function
def g_step():
    def fn():
        z = tf.random.normal((batch, 64))
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(bce(tf.ones((batch, 1)), disc(gen(z, training=True))),
                                              global_batch_size=gb)
        g_opt.apply_gradients(zip(tape.gradient(loss, gen.trainable_variables), gen.trainable_variables))
        return loss
    return strategy.run(fn)


times = []
for step in range(a.steps):
    t = time.perf_counter()
    for _ in range(a.n_critic):
        d_step(real)
    g_step()
    times.append(time.perf_counter() - t)
if strategy.cluster_resolver.task_id == 0:
    print(f"median iteration time: {1000 * statistics.median(times[len(times)//2:]):.3f} ms", flush=True)
