"""A Keras 3 Model.fit under MultiWorkerMirroredStrategy (fails upstream: keras-team/keras#20585)."""
import os
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf
import keras
strategy = tf.distribute.MultiWorkerMirroredStrategy()
with strategy.scope():
    model = keras.Sequential([keras.layers.Input((8,)), keras.layers.Dense(4)])
    model.compile(optimizer="sgd", loss="mse")
x = tf.random.normal((64, 8)); y = tf.random.normal((64, 4))
model.fit(x, y, epochs=1, batch_size=16, verbose=0)
print("fit done")
