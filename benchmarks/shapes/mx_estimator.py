"""MXNet Gluon's Estimator (gluon.contrib.estimator): fit() drives the loop (Adam, an MLP), its Trainer on a
dist_sync kvstore; run with `dprorun --backend mxnet -np 2 --servers 2 python benchmarks/shapes/mx_estimator.py`."""
import argparse, statistics, time
import mxnet as mx
from mxnet import gluon
from mxnet.gluon.contrib.estimator import Estimator
from mxnet.gluon.contrib.estimator.event_handler import BatchBegin, BatchEnd
p = argparse.ArgumentParser(); p.add_argument("--steps", type=int, default=40); a = p.parse_args()
kv = mx.kv.create("dist_sync")
net = gluon.nn.HybridSequential()
net.add(gluon.nn.Dense(512, activation="relu"), gluon.nn.Dense(512, activation="relu"), gluon.nn.Dense(10))
net.initialize(mx.init.Xavier()); net.hybridize()
trainer = gluon.Trainer(net.collect_params(), "adam", {"learning_rate": 1e-3}, kvstore=kv)
x = mx.nd.random.normal(shape=(64 * a.steps, 256))
y = mx.nd.random.randint(0, 10, shape=(64 * a.steps,)).astype("float32")
data = gluon.data.DataLoader(gluon.data.ArrayDataset(x, y), batch_size=64)
times = []
class Timer(BatchBegin, BatchEnd):
    def batch_begin(self, estimator, *args, **kwargs): self.t = time.perf_counter()
    def batch_end(self, estimator, *args, **kwargs):
        mx.nd.waitall(); times.append(time.perf_counter() - self.t)
est = Estimator(net=net, loss=gluon.loss.SoftmaxCrossEntropyLoss(), trainer=trainer, context=mx.cpu())
est.fit(train_data=data, epochs=1, event_handlers=[Timer()])
mx.nd.waitall()
if kv.rank == 0:
    print(f"median iteration time: {statistics.median(times[len(times)//2:]) * 1000:.3f} ms", flush=True)
