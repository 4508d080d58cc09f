"""horovod.tensorflow.keras, `Model.fit`: an embedding bag classifier with Adagrad on synthetic data (tf-keras).

Runs unchanged under `horovodrun -np 2 --gloo python examples/horovod_tf_keras.py` and `dprorun --backend horovod -np 2
python examples/horovod_tf_keras.py` where Horovod was built with TensorFlow. The optimizer is wrapped in
`hvd.DistributedOptimizer` and the initial weights broadcast by Horovod's callback, the way Horovod's Keras examples
do it; `sparse_as_dense` all-reduces the embedding's gradient as a dense tensor. Rank 0 prints the median step time
of the second half of the epoch (a callback's timer, batch start to batch start).
"""
import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
import horovod.tensorflow.keras as hvd  # noqa: E402
import tensorflow as tf  # noqa: E402


class StepTimer(tf.keras.callbacks.Callback):
    """From one batch's start to the next one's: the whole step as the loop runs it, callbacks included."""

    def __init__(self):
        super().__init__()
        self.times = []
        self.started = None

    def on_train_batch_begin(self, batch, logs=None):
        now = time.perf_counter()
        if self.started is not None:
            self.times.append(now - self.started)
        self.started = now


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--vocab", type=int, default=20000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--steps-per-execution", type=int, default=1,
                        help="Keras's steps_per_execution: training steps run inside one call of the step function")
    args = parser.parse_args()
    hvd.init()
    tf.random.set_seed(hvd.rank())
    model = tf.keras.Sequential([
        tf.keras.layers.Input((16,), dtype="int32"),
        tf.keras.layers.Embedding(args.vocab, args.dim),
        tf.keras.layers.GlobalAveragePooling1D(),
        tf.keras.layers.Dense(256, activation="relu"),
        tf.keras.layers.Dense(256, activation="relu"),
        tf.keras.layers.Dense(20),
    ])
    optimizer = hvd.DistributedOptimizer(tf.keras.optimizers.Adagrad(0.01 * hvd.size()), sparse_as_dense=True)
    model.compile(optimizer=optimizer, steps_per_execution=args.steps_per_execution,
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    tokens = tf.random.uniform((args.batch_size * args.steps, 16), 0, args.vocab, dtype=tf.int32)
    labels = tf.random.uniform((args.batch_size * args.steps,), 0, 20, dtype=tf.int32)
    timer = StepTimer()
    model.fit(tokens, labels, batch_size=args.batch_size, epochs=1, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), timer])
    if hvd.rank() == 0:
        half = timer.times[len(timer.times) // 2:]
        per_step = 1000 * statistics.median(half) / args.steps_per_execution  # callbacks run once per call
        print(f"median step {per_step:.2f} ms over the last {len(half) * args.steps_per_execution} steps")


if __name__ == "__main__":
    main()
