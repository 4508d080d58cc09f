"""TensorFlow MultiWorkerMirroredStrategy with tf-keras `Model.fit`: an embedding + dense text classifier on
synthetic data.

Keras 3's `fit` fails under this strategy upstream (keras-team/keras#20585), so this uses tf-keras
(`pip install tf-keras`; TF_USE_LEGACY_KERAS=1, set below before TensorFlow is imported). Runs as a plain TF
worker (TF_CONFIG set by the launcher) and unchanged under `dprorun --backend tf -np 2`. Worker 0 prints the
median step time of the second half (from a Keras callback).
"""
import argparse
import os
import statistics

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402
from keras_common import StepTimer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=64, help="per worker")
    parser.add_argument("--vocab", type=int, default=20000)
    parser.add_argument("--pack-mb", type=float, default=0.0, help="all-reduce bytes_per_pack (0: TF's default)")
    parser.add_argument("--steps-per-execution", type=int, default=1,
                        help="Keras's steps_per_execution: training steps run inside one call of the step function")
    args = parser.parse_args()
    options = tf.distribute.experimental.CommunicationOptions(bytes_per_pack=int(args.pack_mb * (1 << 20)))
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    worker = strategy.cluster_resolver.task_id
    global_batch = args.batch_size * strategy.num_replicas_in_sync
    with strategy.scope():
        model = tf.keras.Sequential([
            tf.keras.layers.Embedding(args.vocab, 64),
            tf.keras.layers.GlobalAveragePooling1D(),
            tf.keras.layers.Dense(512, activation="relu"),
            tf.keras.layers.Dense(512, activation="relu"),
            tf.keras.layers.Dense(4),
        ])
        model.compile(optimizer=tf.keras.optimizers.Adam(1e-3), steps_per_execution=args.steps_per_execution,
                      loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    tf.random.set_seed(0)
    x = tf.random.uniform((global_batch * 4, 32), maxval=args.vocab, dtype=tf.int64)
    y = tf.random.uniform((global_batch * 4,), maxval=4, dtype=tf.int64)
    data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(global_batch)
    timer = StepTimer()
    model.fit(data, epochs=1, steps_per_epoch=args.steps, verbose=0, callbacks=[timer])
    if worker == 0:
        second_half = timer.times[len(timer.times) // 2:]  # the callbacks see one batch per call: per step
        print(f"median iteration time: {1000 * statistics.median(second_half) / args.steps_per_execution:.3f} ms",
              flush=True)


if __name__ == "__main__":
    main()
