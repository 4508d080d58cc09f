"""TensorFlow shapes of session 62 (MultiWorkerMirroredStrategy, 2 workers): --alternating-loop (a custom loop of
two step tf.functions of its own, one applying the encoder's gradients, the other the decoder's, called on alternate
steps: an autoencoder's halves trained in turn), --tbptt-loop (truncated backpropagation through time: an LSTM
language model whose state each replica carries from one step to the next, fed back into strategy.run as per-replica
values; gradients clipped by global norm, SGD), --keras3-loop (Keras 3, not tf-keras: a custom loop of a step
tf.function with Keras 3's Adam; Keras 3's fit under this strategy fails upstream, its loops run)."""
import argparse, os, statistics, time
p = argparse.ArgumentParser(); p.add_argument("--steps", type=int, default=40)
for flag in ("--alternating-loop", "--tbptt-loop", "--keras3-loop"):
    p.add_argument(flag, action="store_true")
a = p.parse_args()
if not a.keras3_loop:
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf
if a.keras3_loop:
    import keras
else:
    keras = tf.keras
strategy = tf.distribute.MultiWorkerMirroredStrategy()
per_replica = 32
gb = per_replica * strategy.num_replicas_in_sync
VOCAB, SEQ = 400, 24
times = []
if a.keras3_loop:
    with strategy.scope():
        model = keras.Sequential([keras.layers.Input((256,)), keras.layers.Dense(512, activation="relu"),
                                  keras.layers.Dense(10)])
        opt = keras.optimizers.Adam(1e-3)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    x, y = tf.random.normal((gb * 4, 256)), tf.random.uniform((gb * 4,), maxval=10, dtype=tf.int64)
    data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(gb)

    def replica_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(loss_fn(yb, model(xb, training=True)), global_batch_size=gb)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    @tf.function
    def step(xb, yb):
        return strategy.reduce("SUM", strategy.run(replica_step, args=(xb, yb)), axis=None)

    batches = iter(strategy.experimental_distribute_dataset(data))
    for _ in range(a.steps):
        start = time.perf_counter()
        step(*next(batches)).numpy()
        times.append(time.perf_counter() - start)
elif a.alternating_loop:
    with strategy.scope():
        encoder = keras.Sequential([keras.Input((256,)), keras.layers.Dense(512, activation="relu"),
                                    keras.layers.Dense(64)])
        decoder = keras.Sequential([keras.Input((64,)), keras.layers.Dense(512, activation="relu"),
                                    keras.layers.Dense(256)])
        opt = keras.optimizers.Adam(1e-3)
        opt.build(encoder.trainable_variables + decoder.trainable_variables)  # one optimizer, two variable lists
    features = tf.random.normal((gb * 4, 256))
    data = tf.data.Dataset.from_tensor_slices(features).repeat().batch(gb)

    def half_step(variables_of):
        def replica_step(x):
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(tf.reduce_mean(tf.square(decoder(encoder(x)) - x), axis=1),
                                                  global_batch_size=gb)
            variables = variables_of()
            opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
            return loss

        @tf.function
        def step(x):
            return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(replica_step, args=(x,)), axis=None)
        return step

    steps = [half_step(lambda: encoder.trainable_variables), half_step(lambda: decoder.trainable_variables)]
    batches = iter(strategy.experimental_distribute_dataset(data))
    for k in range(a.steps):
        start = time.perf_counter()
        steps[k % 2](next(batches)).numpy()
        times.append(time.perf_counter() - start)
else:
    with strategy.scope():
        embed = keras.layers.Embedding(VOCAB, 64)
        lstm = keras.layers.LSTM(128, return_sequences=True, return_state=True)
        head = keras.layers.Dense(VOCAB)
        opt = keras.optimizers.SGD(0.5)
    stream = tf.random.uniform((gb, a.steps * SEQ + 1), maxval=VOCAB, dtype=tf.int32, seed=1)
    chunks = tf.data.Dataset.from_tensor_slices(tf.stack([stream[:, k * SEQ: k * SEQ + SEQ + 1]
                                                          for k in range(a.steps)])).unbatch().batch(gb)

    def replica_step(chunk, h, c):
        with tf.GradientTape() as tape:
            hidden, h, c = lstm(embed(chunk[:, :-1]), initial_state=[h, c])
            per_token = keras.losses.sparse_categorical_crossentropy(chunk[:, 1:], head(hidden), from_logits=True)
            loss = tf.nn.compute_average_loss(tf.reduce_mean(per_token, axis=1), global_batch_size=gb)
        variables = embed.trainable_variables + lstm.trainable_variables + head.trainable_variables
        grads, _ = tf.clip_by_global_norm(tape.gradient(loss, variables), 1.0)
        opt.apply_gradients(zip(grads, variables))
        return loss, tf.stop_gradient(h), tf.stop_gradient(c)

    @tf.function
    def step(chunk, h, c):
        loss, h, c = strategy.run(replica_step, args=(chunk, h, c))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, loss, axis=None), h, c

    def zeros(_context):
        return tf.zeros((per_replica, 128))

    h = strategy.experimental_distribute_values_from_function(zeros)
    c = strategy.experimental_distribute_values_from_function(zeros)
    batches = iter(strategy.experimental_distribute_dataset(chunks))
    for k in range(a.steps):
        start = time.perf_counter()
        loss, h, c = step(next(batches), h, c)
        loss.numpy()
        times.append(time.perf_counter() - start)
if strategy.cluster_resolver.task_id == 0:
    print(f"median iteration time: {statistics.median(times[len(times)//2:]) * 1000:.3f} ms")
