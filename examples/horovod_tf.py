"""horovod.tensorflow, custom training loop: a small conv net or an MLP on synthetic data (tf-keras, Gloo on the CPU).

Runs unchanged under `horovodrun -np 2 --gloo python examples/horovod_tf.py` and `dprorun --backend horovod -np 2
python examples/horovod_tf.py` where Horovod was built with TensorFlow (scripts/install-horovod does it when
TensorFlow is installed first). horovod.tensorflow 0.28.1 needs tf.Variable, so this script uses tf-keras
(TF_USE_LEGACY_KERAS=1): Keras 3 variables have no .ref(), which its DistributedGradientTape calls. Rank 0 prints
the median step time of the second half.
"""
import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
import horovod.tensorflow as hvd  # noqa: E402
import tensorflow as tf  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--model", choices=("conv", "mlp"), default="conv",
                        help="conv: two convolutions under a dense head; mlp: six dense layers on flat inputs")
    parser.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    args = parser.parse_args()
    hvd.init()
    tf.random.set_seed(hvd.rank())
    if args.model == "conv":
        layers = [tf.keras.layers.Input((32, 32, 3)),
                  tf.keras.layers.Conv2D(32, 3, activation="relu"),
                  tf.keras.layers.MaxPooling2D(),
                  tf.keras.layers.Conv2D(64, 3, activation="relu"),
                  tf.keras.layers.Flatten(),
                  tf.keras.layers.Dense(args.width, activation="relu")]
    else:
        layers = [tf.keras.layers.Input((32, 32, 3)), tf.keras.layers.Flatten()]
        layers += [tf.keras.layers.Dense(args.width * 4, activation="relu") for _ in range(6)]
    model = tf.keras.Sequential(layers + [tf.keras.layers.Dense(10)])
    if args.optimizer == "sgd":
        optimizer = tf.keras.optimizers.SGD(0.01 * hvd.size(), momentum=0.9)
    else:
        optimizer = tf.keras.optimizers.Adam(0.001 * hvd.size())
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    images = tf.random.normal((args.batch_size, 32, 32, 3))
    labels = tf.random.uniform((args.batch_size,), 0, 10, dtype=tf.int32)

    @tf.function
    def train_step(first: bool):
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        if first:  # after the first step the optimizer's slots exist: broadcast them with the weights
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(optimizer.variables(), root_rank=0)
        return loss

    times = []
    for step in range(args.steps):
        started = time.perf_counter()
        loss = train_step(step == 0)
        float(loss)
        times.append(time.perf_counter() - started)
    if hvd.rank() == 0:
        half = times[len(times) // 2:]
        print(f"loss {float(loss):.4f}; median step {1000 * statistics.median(half):.2f} ms "
              f"over the last {len(half)} steps")


if __name__ == "__main__":
    main()
