"""TensorFlow MultiWorkerMirroredStrategy, transfer learning as Keras users write it (tf-keras): the head fitted with
the base frozen, then the base unfrozen, the model compiled again (a new train_function, which all-reduces every
layer's gradients) and fitted again (--epochs: with a validation pass after each epoch).

Runs as a plain TF worker (TF_CONFIG set by the launcher) and unchanged under `dprorun --backend tf -np 2`. Worker
0 prints the median step time of the second fit's second half.
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
    parser.add_argument("--head-steps", type=int, default=4, help="steps of the first fit (the base frozen)")
    parser.add_argument("--steps", type=int, default=40, help="steps of the second fit (everything trained)")
    parser.add_argument("--width", type=int, default=1024, help="the base's two Dense layers")
    parser.add_argument("--batch-size", type=int, default=64, help="per worker")
    parser.add_argument("--epochs", type=int, default=1,
                        help="the second fit's steps in this many epochs, each followed by a validation pass (4 batches)")
    parser.add_argument("--pack-mb", type=float, default=0.0, help="all-reduce bytes_per_pack (0: TF's default)")
    args = parser.parse_args()
    options = tf.distribute.experimental.CommunicationOptions(bytes_per_pack=int(args.pack_mb * (1 << 20)))
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    worker = strategy.cluster_resolver.task_id
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    with strategy.scope():
        base = tf.keras.Sequential([tf.keras.layers.Dense(args.width, activation="relu", input_shape=(256,)),
                                    tf.keras.layers.Dense(args.width, activation="relu")])
        model = tf.keras.Sequential([base, tf.keras.layers.Dense(10)])
        base.trainable = False
        model.compile(tf.keras.optimizers.SGD(0.01), loss)
    tf.random.set_seed(0)
    global_batch = args.batch_size * strategy.num_replicas_in_sync
    features = tf.random.normal((global_batch * 4, 256))
    labels = tf.random.uniform((global_batch * 4,), 0, 10, tf.int32)
    data = tf.data.Dataset.from_tensor_slices((features, labels)).repeat().batch(global_batch)
    model.fit(data, steps_per_epoch=args.head_steps, epochs=1, verbose=0)
    with strategy.scope():
        base.trainable = True
        model.compile(tf.keras.optimizers.SGD(0.001, momentum=0.9), loss)
    timer = StepTimer()
    validation = tf.data.Dataset.from_tensor_slices((features, labels)).batch(global_batch) if args.epochs > 1 else None
    model.fit(data, steps_per_epoch=args.steps // args.epochs, epochs=args.epochs, verbose=0, callbacks=[timer],
              validation_data=validation)
    if worker == 0:
        print(f"median iteration time: {1000 * statistics.median(timer.times[len(timer.times) // 2:]):.3f} ms",
              flush=True)


if __name__ == "__main__":
    main()
