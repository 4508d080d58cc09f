"""The shape of TensorFlow's "multi-worker training with Keras" tutorial: TF_CONFIG from the launcher,
MultiWorkerMirroredStrategy, the dataset batched by the global batch size, a conv net built and compiled inside
strategy.scope(), and model.fit(epochs=3, steps_per_epoch=N). Here: `dprorun --backend tf -np 2 python ...`
(tf-keras: TF_USE_LEGACY_KERAS=1, set below)."""
import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# tf.keras as Keras 2 (tf-keras): Keras 3's Model.fit under MultiWorkerMirroredStrategy fails upstream
# (keras-team/keras#20585), plainly and under dprorun alike (dprorun names it and this way out)
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--steps-per-epoch", type=int, default=20)
p.add_argument("--steps", type=int, default=None,  # as benchmarks/unseen_shapes.py passes it
               help="steps in all: whole epochs of --steps-per-epoch")
a = p.parse_args()
if a.steps:
    a.epochs = max(1, a.steps // a.steps_per_epoch)
per_worker_batch_size = 64
tf_config = json.loads(os.environ["TF_CONFIG"])
num_workers = len(tf_config["cluster"]["worker"])
strategy = tf.distribute.MultiWorkerMirroredStrategy()
global_batch_size = per_worker_batch_size * num_workers


def mnist_dataset(batch_size):
    x = np.random.RandomState(0).rand(6000, 28, 28).astype(np.float32)
    y = np.random.RandomState(1).randint(0, 10, 6000).astype(np.int64)
    return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(6000).repeat().batch(batch_size)


def build_and_compile_cnn_model():
    model = tf.keras.Sequential([
        tf.keras.layers.InputLayer(input_shape=(28, 28)),
        tf.keras.layers.Reshape(target_shape=(28, 28, 1)),
        tf.keras.layers.Conv2D(32, 3, activation="relu"),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(128, activation="relu"),
        tf.keras.layers.Dense(10)])
    model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  optimizer=tf.keras.optimizers.SGD(learning_rate=0.001), metrics=["accuracy"])
    return model


multi_worker_dataset = mnist_dataset(global_batch_size)
with strategy.scope():
    multi_worker_model = build_and_compile_cnn_model()
multi_worker_model.fit(multi_worker_dataset, epochs=a.epochs, steps_per_epoch=a.steps_per_epoch, verbose=2)
