"""TensorFlow MultiWorkerMirroredStrategy, custom training loop: a small conv net on synthetic data.

Runs as a plain TF worker (TF_CONFIG set by the launcher, e.g. two local workers on two 127.0.0.1 ports) and
unchanged under `dprorun --backend tf -np 2`. Worker 0 prints the median step time of the second half.
"""
import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--pack-mb", type=float, default=0.0,
                        help="all-reduce pack size (CommunicationOptions bytes_per_pack; 0: TF's default)")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--steps-per-call", type=int, default=1,
                        help="training steps run in a tf.range loop inside one call of the tf.function")
    parser.add_argument("--accumulate", type=int, default=1,
                        help="gradient accumulation: this many micro-batch calls (gradients kept on the worker), "
                             "then one call that all-reduces and applies them")
    parser.add_argument("--eval-every", type=int, default=0,
                        help="every this many steps, an evaluation tf.function (strategy.run, the loss and accuracy "
                             "reduced over the workers) on 3 batches")
    parser.add_argument("--own-profiler", default="",
                        help="FIRST,LAST: the script profiles those steps itself (tf.profiler.experimental.start and "
                             "stop, as a user's script does), into a temporary folder")
    parser.add_argument("--fail-at-step", type=int, default=-1, help="test knob: worker 1 raises at this step")
    args = parser.parse_args()
    own_first, own_last = map(int, args.own_profiler.split(",")) if args.own_profiler else (-1, -1)
    options = tf.distribute.experimental.CommunicationOptions(bytes_per_pack=int(args.pack_mb * (1 << 20)))
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    worker = strategy.cluster_resolver.task_id
    with strategy.scope():
        model = tf.keras.Sequential([
            tf.keras.layers.Input((32, 32, 3)),
            tf.keras.layers.Conv2D(32, 3, activation="relu"),
            tf.keras.layers.Conv2D(32, 3, activation="relu"),
            tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(args.width, activation="relu"),
            tf.keras.layers.Dense(10),
        ])
        optimizer = tf.keras.optimizers.SGD(0.01, momentum=0.9)
        # per-worker gradient sums for --accumulate (ON_READ: each worker keeps its own, nothing synchronised)
        sums = [tf.Variable(tf.zeros_like(v), trainable=False, synchronization=tf.VariableSynchronization.ON_READ,
                            aggregation=tf.VariableAggregation.SUM)
                for v in (model.trainable_variables if args.accumulate > 1 else [])]
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                            reduction=tf.keras.losses.Reduction.NONE)
    global_batch = args.batch_size * strategy.num_replicas_in_sync

    def step_fn(x, y):
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(loss_fn(y, model(x, training=True)), global_batch_size=global_batch)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def train_step(x, y):
        if args.steps_per_call == 1:
            return strategy.run(step_fn, args=(x, y))
        loss = tf.constant(0.0)
        for _ in tf.range(args.steps_per_call):
            loss = strategy.reduce("SUM", strategy.run(step_fn, args=(x, y)), axis=None)
        return loss

    def micro_fn(x, y):
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(loss_fn(y, model(x, training=True)), global_batch_size=global_batch)
        for total, grad in zip(sums, tape.gradient(loss, model.trainable_variables)):
            total.assign_add(grad)

    def apply_fn():
        optimizer.apply_gradients(zip([total.read_value() / args.accumulate for total in sums],
                                      model.trainable_variables))  # the all-reduce happens here
        for total in sums:
            total.assign(tf.zeros_like(total))

    @tf.function
    def micro_step(x, y):
        strategy.run(micro_fn, args=(x, y))

    @tf.function
    def apply_step():
        strategy.run(apply_fn)

    @tf.function
    def eval_step(x, y):
        def replica(x, y):
            logits = model(x, training=False)
            correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, -1), y), tf.float32))
            return tf.reduce_sum(loss_fn(y, logits)), correct
        loss, correct = strategy.run(replica, args=(x, y))
        return strategy.reduce("SUM", loss, axis=None), strategy.reduce("SUM", correct, axis=None)

    tf.random.set_seed(worker)
    x = tf.random.normal((args.batch_size, 32, 32, 3))
    y = tf.random.uniform((args.batch_size,), maxval=10, dtype=tf.int64)
    times = []
    for step in range(args.steps // args.steps_per_call):
        if step == args.fail_at_step and worker == 1:
            raise RuntimeError(f"injected failure at step {step} (--fail-at-step)")
        if step == own_first:
            import tempfile

            own_folder = tempfile.mkdtemp(prefix="own_profiler_")
            tf.profiler.experimental.start(own_folder)
        started = time.perf_counter()
        if args.accumulate > 1:
            for _ in range(args.accumulate):
                micro_step(x, y)
            apply_step()
        else:
            train_step(x, y)
        times.append(time.perf_counter() - started)
        if args.eval_every and step % args.eval_every == args.eval_every - 1:
            for _ in range(3):
                eval_step(x, y)
        if step == own_last:
            tf.profiler.experimental.stop()
            print(f"worker {worker}: own profile in {own_folder}", flush=True)
    if worker == 0:
        second_half = times[len(times) // 2:]
        print(f"median iteration time: {1000 * statistics.median(second_half) / args.steps_per_call:.3f} ms",
              flush=True)


if __name__ == "__main__":
    main()
