"""Transfer learning as Keras users write it (tf-keras under MultiWorkerMirroredStrategy): fit the head with the
base frozen, unfreeze the base, compile again (a new train_function, which all-reduces every layer's gradients),
fit again."""
import argparse
import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--head-steps", type=int, default=2)
parser.add_argument("--tune-steps", type=int, default=40)
args = parser.parse_args()
strategy = tf.distribute.MultiWorkerMirroredStrategy()
with strategy.scope():
    base = tf.keras.Sequential([tf.keras.layers.Dense(512, activation="relu", input_shape=(256,)),
                                tf.keras.layers.Dense(512, activation="relu")])
    model = tf.keras.Sequential([base, tf.keras.layers.Dense(10)])
    base.trainable = False
    model.compile(tf.keras.optimizers.SGD(0.01), tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
features = tf.random.normal((64 * 8, 256))
labels = tf.random.uniform((64 * 8,), 0, 10, tf.int32)
data = tf.data.Dataset.from_tensor_slices((features, labels)).repeat().batch(128)
model.fit(data, steps_per_epoch=args.head_steps, epochs=1, verbose=0)
with strategy.scope():
    base.trainable = True
    model.compile(tf.keras.optimizers.SGD(0.001), tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
model.fit(data, steps_per_epoch=args.tune_steps, epochs=1, verbose=0)
