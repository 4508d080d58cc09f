"""Training scripts of shapes no example has (benchmarks/shapes/), each run once under dprorun: what the job-end
self-check says of the replay of the job as it ran against the run's own clean iterations.

Shapes: DDP with gradient accumulation (no_sync), find_unused_parameters with a branch used every other step,
static_graph, gradient_as_bucket_view with bf16 autocast, a GAN (two DDP models), activation checkpointing,
ZeroRedundancyOptimizer, torch.compile(DDP(model)) by the script, a loss all-reduced for logging each step (with and
without DataLoader workers), epochs over a DistributedSampler with a validation pass after each, a sparse-gradient
EmbeddingBag, a frozen trunk, AdamW with OneCycleLR and clipping, Hugging Face Trainer with gradient accumulation
and with evaluation every 8 steps, Accelerate's and Lightning's own loops (with and without gradient accumulation;
Lightning steps the optimizer with a closure; Lightning under --autotune; bf16 mixed precision in both; Lightning
validating every 10 steps); Horovod with backward_passes_per_step=2; tf-keras fit of a GRU over 2 epochs, of a conv
net with validation data, a schedule and ReduceLROnPlateau, and of an MLP with steps_per_execution=4; a TensorFlow
custom loop running 3 steps per call of its tf.function; DDP with a GradScaler under bf16 autocast, an LSTM on
sequences of a new length every step, uneven inputs under DDP's join; Horovod with fp16 compression, with the loss
all-reduced every step, with synchronize() and clipping; tf-keras fit of an embedding model with Adagrad (plain,
mixed_bfloat16, the embedding frozen); session 34: a frozen teacher's no_grad forward (distillation), encoder and
decoder in a DDP each, tied embedding and output weights, an EMA AveragedModel with StepLR, the script's own
per-parameter gradient hooks, find_unused_parameters with a branch drawn every step, DistributedSampler epochs of 5
steps with a short last batch, a Keras model's own train_step with clipping and two losses, Horovod with groups=2,
with the parameters re-broadcast every 10 steps, a BatchNorm conv net with SGD; session 35: LBFGS (the closure
run up to 4 times a step), post-local SGD with a periodic model averager; session 36: DDP with SparseAdam for a
table and AdamW for the rest, a channels_last conv net with Nesterov SGD and a warm-up-cosine schedule, a Horovod
conv net with
AdamW validating every 5 steps, Horovod accumulating 2 micro-batches by hand with SGD momentum, a Horovod GAN (a
DistributedOptimizer per model, stepped in turn), tf-keras fit with
Keras's TensorBoard callback (scalars every batch, histograms, its own profile of batches 12-14), a functional
tf-keras model of two inputs with class weights and Nesterov SGD, tf-keras fit under mixed_float16 and on NumPy
arrays, a TF loop over a distributed dataset's iterator, a TensorFlow GAN whose step calls a discriminator's
and a generator's tf.function (once, and 3 critic calls a step); session 37: DDP saving a checkpoint on rank 0
every 10 steps behind a barrier, an input-bound DDP loop (a Dataset augmenting on the CPU, no loader workers), the
gradients' norm all-reduced by hand for clipping, metrics gathered with all_gather_object, tf-keras fit with
ModelCheckpoint and with BackupAndRestore saving every 10 batches, a TF loop over epochs of a dataset whose last
batch is partial (a retrace) with the loss reduced after each step, Horovod's elastic API (hvd.elastic.run, a
TorchState committed every 5 steps), Horovod summing the gradients (op=hvd.Sum), Horovod with a LayerNorm MLP,
AdamW and a trust ratio applied by hand between synchronize() and the step; session 38: a DDP module called twice a
step (SimCLR's two views), CLIP's differentiable all_gather in the loss, a mixture-of-experts layer routing tokens
with all_to_all_single with its experts kept out of DDP, rank 0 alone logging and snapshotting every step, a barrier
before every step, one rank waiting 8 ms for its input every step, accumulation over 2 micro-batches without
no_sync (an all-reduce per micro-batch), a WGAN-GP (the penalty's input gradient by autograd.grad with
create_graph, a generator DDP stepped every 5th critic step), DDP of a torch.compile'd module, Hugging Face
Trainer with gradient checkpointing and the loss logged every 5 steps; tf-keras fit with synchronized
BatchNormalization, a TF loop under the script's own CommunicationOptions (256 KiB packs, RING), a TF loop
all-reducing its gradients itself and applying them with experimental_aggregate_gradients=False; Horovod with
hvd.allgather of the features in the loss, a sparse-gradient
embedding (all-gathered, and sparse_as_dense), gradient_predivide_factor=2; session 39: DDP of layers under
weight_norm and spectral_norm parametrizations, a transformer block on scaled_dot_product_attention with fused
AdamW and a warm-up LambdaLR, a model taking and returning dicts, zero_grad(set_to_none=False) with for-loop SGD,
torch.distributed.checkpoint saves every 10 steps, a batch that grows 4x at step 24, a Lightning GAN with manual
optimization, DDP and Horovod of a torch.jit.script'ed model, a DDP model returning a dataclass; Horovod with one
rank's shard 6 batches short (hvd.join), TF loops accumulating 2 micro-batches inside the step and stepping two
optimizers; session 40: SAM, fp16 autocast with a GradScaler, tensor and pipeline parallelism (named, not profiled),
loader workers by spawn and forkserver, a transformers GPT-2 loop; session 41: the official tutorials' shapes (torch's
ImageNet example with epochs, validation and a checkpoint; Horovod's pytorch_mnist; TensorFlow's multi-worker Keras
fit); session 42: a float64 model, bfloat16 parameters, a loop in a thread of the script's, torch's composable
replicate(), Horovod in a thread and in float64, a TF loop and a Keras fit in a thread; session 43: DDP's buffer
broadcast of a BatchNorm net, an optimizer step skipped every 4th step, a loop trained for 6 s (its stop all-reduced),
Adafactor on a token model, bf16_compress_hook, Horovod of a torch.compile'd model and with hvd.broadcast_object
every step, Keras fit over a Python generator and of MobileNetV2, Lightning's DDPStrategy with static_graph and
gradient_as_bucket_view, Lightning clipping by norm, Hugging Face Trainer with torch_compile and Adafactor; session
51: DDP's forward under save_on_cpu, a compiled optimizer step, ReduceLROnPlateau on an all-reduced validation loss,
a custom autograd Function, SWA with update_bn, torch.distributed.checkpoint.async_save every 10 steps, the script's
own full backward hook and forward hook on the DDP module; a TF Keras transformer with AdamW and a warm-up schedule of its own;
Horovod gradients shared by hand (grouped_allreduce; allreduce_async_ after the backward and from gradient hooks;
reducescatter and allgather); session 52: DDP stepped by an optimizer class of the script's own (a Lion that is no
torch.optim.Optimizer), DDP with SGD applied in place and no optimizer object, DDP with a monitored_barrier every 10
steps, DDP of a model with a bfloat16 trunk and a float32 head, DDP of a model trained in eval mode; a Keras fit whose Adam keeps an EMA of the weights,
a TF loop with Lookahead written by hand, a TF loop calling its model with training=False inside the tape; Horovod fine-tuning a head over a frozen conv trunk with AdamW, Horovod with one of
two heads drawn each step, Horovod with its trunk frozen mid-run by requires_grad_(False), Horovod of a model
trained in eval mode (MXNet's record(train_mode=False): benchmarks/mxnet_replay_accuracy.py --models
predict-mode); session 53: the ranks spawned by the script from the one process launched (`-np 1`): pytorch.org's
DDP tutorial (mp.spawn, a MASTER_PORT of its own), init_method="tcp://..." with a conv net and Adam, the fork start
method with a default address; a multiprocessing.Process per rank averaging gradients by hand (pytorch.org's
"Writing Distributed Applications"), spawned and forked; workers started by torch elastic's Python API
(elastic_launch) and torchrun's main from the script; a launcher of the script's own running each rank as a
subprocess; Lightning's
ddp_spawn and ddp_notebook, Ignite's Parallel(nproc_per_node=2), Accelerate's notebook_launcher; session 54:
scripts that copy the model they train: an EMA by torch.optim.swa_utils.AveragedModel of the DDP model and of the
model Horovod trains, the best model kept by copy.deepcopy and the whole model written by torch.save (DDP, Horovod),
DDP with torch's fp16_compress_hook registered by the script at step 10 (in the window) and at step 40 (after it);
sessions 55-60: see the comments in JOBS; session 62: 1-3 micro-batches a step from a token budget, DDP over the
script's own group, truncated BPTT with a carried LSTM state, lazy modules, an encoder and a decoder trained on
alternate steps (DDP), PGD adversarial training, a TF loop's two step functions in turn, a TF LSTM whose per-replica
state is carried, a Keras 3 custom loop; session 63: a backbone unfrozen in the window (gradients averaged by hand),
layer-wise learning-rate decay, learned task weights outside the DDP model, a batch size per rank, 1 MB buckets, Adam
stepped with a closure, LayerDrop with gradients averaged by hand (other calls each step); session 64: a trunk frozen
inside the window (find_unused_parameters), complex-valued parameters, ZeRO under Join with uneven inputs, a flat
all-reduce per layer from multi-grad hooks, BatchNorm statistics all-reduced by hand, top-1 % gradients all-gathered
by hand (torch.distributed and horovod.torch), local SGD by hand (both: named as unprofiled), Horovod process sets,
tf-keras fit with validation_split and a LearningRateScheduler, a TF loop's persistent tape applied by two optimizers,
tf-keras fit of a masked LSTM.
Frameworks that are not installed are skipped with a line saying so.

    python benchmarks/unseen_shapes.py [--only NAME,...]

Last line: `self-check: A of N agree`.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = os.path.join(REPO, "benchmarks", "shapes")
# name: (dprorun options, script (in benchmarks/shapes, or a path from the repository root), script arguments,
# module the job needs)
JOBS = {
    "ddp-accumulate-2": ([], "ddp_shapes.py", ["--accum", "2"], "torch"),
    "ddp-unused-branch": ([], "ddp_shapes.py", ["--unused"], "torch"),
    "ddp-static-graph": ([], "ddp_shapes.py", ["--static"], "torch"),
    "ddp-bucket-view-bf16": ([], "ddp_shapes.py", ["--bucket-view", "--amp"], "torch"),
    "ddp-gan": ([], "ddp_more.py", ["--gan"], "torch"),
    "ddp-checkpointing": ([], "ddp_more.py", ["--ckpt"], "torch"),
    "ddp-zero": ([], "ddp_more.py", ["--zero"], "torch"),
    "ddp-logged-loss": ([], "ddp_metric.py", [], "torch"),
    "ddp-logged-loss-loader-workers": ([], "ddp_metric.py", ["--workers", "2"], "torch"),
    "ddp-compiled-by-the-script": ([], "ddp_compiled.py", [], "torch"),
    "ddp-eval-epochs": ([], "ddp_data.py", ["--eval"], "torch"),
    "ddp-sparse-embedding": ([], "ddp_data.py", ["--sparse"], "torch"),
    "ddp-frozen-trunk": ([], "ddp_data.py", ["--frozen"], "torch"),
    "ddp-adamw-onecycle-clip": ([], "ddp_data.py", ["--sched"], "torch"),
    "ddp-accelerate": ([], "ddp_trainers.py", ["--framework", "accelerate"], "accelerate"),
    "ddp-accelerate-accumulate-2": ([], "ddp_trainers.py", ["--framework", "accelerate", "--accum", "2"],
                                    "accelerate"),
    "ddp-lightning": ([], "ddp_trainers.py", ["--framework", "lightning"], "lightning"),
    "hf-trainer-accumulate-2": ([], "examples/hf_trainer.py", ["--accumulate", "2"], "transformers"),
    "hf-trainer-eval-every-8": ([], "examples/hf_trainer.py", ["--eval-every", "8"], "transformers"),
    "ddp-lightning-autotune": (["--autotune"], "ddp_trainers.py", ["--framework", "lightning"], "lightning"),
    "ddp-lightning-bf16-validation": ([], "ddp_trainers.py", ["--framework", "lightning", "--bf16", "--val"],
                                      "lightning"),
    "ddp-accelerate-bf16": ([], "ddp_trainers.py", ["--framework", "accelerate", "--bf16"], "accelerate"),
    "ddp-lightning-accumulate-2": ([], "ddp_trainers.py", ["--framework", "lightning", "--accum", "2"], "lightning"),
    "horovod-accumulate-2": (["--backend", "horovod"], "hvd_accum.py", [], "horovod"),
    "tf-keras-gru-fit": (["--backend", "tf"], "tf_gru_fit.py", [], "tensorflow"),
    "tf-keras-fit-validation": (["--backend", "tf"], "tf_fit_val.py", [], "tensorflow"),
    "tf-keras-fit-steps-per-execution-4": (["--backend", "tf"], "tf_fit_spe.py", [], "tensorflow"),
    "ddp-gradscaler-bf16": ([], "ddp_amp_varlen_join.py", ["--scaler"], "torch"),
    "ddp-lstm-varying-lengths": ([], "ddp_amp_varlen_join.py", ["--varlen"], "torch"),
    "ddp-join-uneven-inputs": ([], "ddp_amp_varlen_join.py", ["--join"], "torch"),
    "horovod-fp16-compression": (["--backend", "horovod"], "hvd_variants.py", ["--fp16"], "horovod"),
    "horovod-loss-allreduce-each-step": (["--backend", "horovod"], "hvd_variants.py", ["--metric"], "horovod"),
    "horovod-synchronize-clip": (["--backend", "horovod"], "hvd_variants.py", ["--sync"], "horovod"),
    "tf-keras-embedding-adagrad-fit": (["--backend", "tf"], "tf_embedding_fit.py", [], "tensorflow"),
    "tf-keras-embedding-bf16-fit": (["--backend", "tf"], "tf_embedding_fit.py", ["--mixed"], "tensorflow"),
    "tf-keras-embedding-frozen-fit": (["--backend", "tf"], "tf_embedding_fit.py", ["--frozen"], "tensorflow"),
    "tf-custom-loop-3-steps-per-call": (["--backend", "tf", "--warmup", "3", "--active", "6", "--clean", "5"],
                                        "examples/tf_custom_loop.py", ["--steps-per-call", "3", "--steps", "60"],
                                        "tensorflow"),  # 20 calls: 3 + 6 + 5 of them the window
    "ddp-distill": ([], "ddp_session34.py", ["--distill"], "torch"),
    "ddp-two-ddp": ([], "ddp_session34.py", ["--two-ddp"], "torch"),
    "ddp-tied": ([], "ddp_session34.py", ["--tied"], "torch"),
    "ddp-ema": ([], "ddp_session34.py", ["--ema"], "torch"),
    "ddp-grad-hooks": ([], "ddp_session34.py", ["--grad-hooks"], "torch"),
    "ddp-dynamic": ([], "ddp_session34.py", ["--dynamic"], "torch"),
    "ddp-short-epochs": ([], "ddp_session34.py", ["--short-epochs"], "torch"),
    "ddp-lbfgs": ([], "ddp_session35.py", ["--lbfgs"], "torch"),
    "ddp-post-local-sgd": ([], "ddp_session35.py", ["--localsgd"], "torch"),
    "ddp-sparse-adam-and-adamw": ([], "ddp_session36.py", ["--two-optimizers"], "torch"),
    "ddp-channels-last-nesterov-cosine": ([], "ddp_session36.py", ["--channels-last"], "torch"),
    "tf-keras-own-train-step-two-heads": (["--backend", "tf"], "tf_train_step.py", [], "tensorflow"),
    "tf-keras-fit-validation-freq-evaluate-predict": (["--backend", "tf"], "tf_fit_val.py", ["--after"], "tensorflow"),
    "horovod-groups": (["--backend", "horovod"], "hvd_groups.py", ["--groups"], "horovod"),
    "horovod-broadcast-every": (["--backend", "horovod"], "hvd_groups.py", ["--broadcast-every"], "horovod"),
    "horovod-conv-sgd": (["--backend", "horovod"], "hvd_groups.py", ["--conv-sgd"], "horovod"),
    "horovod-conv-adamw-eval-every-5": (["--backend", "horovod"], "hvd_session36.py", ["--eval-every", "5"], "horovod"),
    "horovod-accumulate-by-hand-sgd-momentum": (["--backend", "horovod"], "hvd_session36.py", ["--accum-loop"],
                                                "horovod"),
    "horovod-gan-two-optimizers": (["--backend", "horovod"], "hvd_session36.py", ["--gan"], "horovod"),
    "tf-keras-fit-tensorboard-callback": (["--backend", "tf"], "tf_session36.py", ["--tensorboard"], "tensorboard"),
    "tf-keras-functional-two-inputs-class-weights": (["--backend", "tf"], "tf_session36.py", ["--two-inputs"],
                                                     "tensorflow"),
    "tf-keras-fit-mixed-float16": (["--backend", "tf"], "tf_session36.py", ["--mixed16"], "tensorflow"),
    "tf-keras-fit-numpy-arrays": (["--backend", "tf"], "tf_session36.py", ["--numpy"], "tensorflow"),
    "tf-loop-distributed-iterator": (["--backend", "tf"], "tf_session36.py", ["--loop"], "tensorflow"),
    "tf-gan-two-step-functions": (["--backend", "tf"], "tf_gan.py", [], "tensorflow"),
    "tf-wgan-3-critic-calls-a-step": (["--backend", "tf"], "tf_gan.py", ["--n-critic", "3"], "tensorflow"),
    "ddp-checkpoint-every-10": ([], "ddp_session37.py", ["--checkpoint-every", "10"], "torch"),
    "ddp-input-bound-loader": ([], "ddp_session37.py", ["--slow-input"], "torch"),
    "ddp-norm-all-reduced-by-hand": ([], "ddp_session37.py", ["--clip-by-hand"], "torch"),
    "ddp-metrics-all-gather-object": ([], "ddp_session37.py", ["--gather-metrics"], "torch"),
    "tf-keras-fit-model-checkpoint": (["--backend", "tf"], "tf_session37.py", ["--checkpoint"], "tensorflow"),
    "tf-keras-fit-backup-and-restore": (["--backend", "tf"], "tf_session37.py", ["--backup"], "tensorflow"),
    "tf-loop-partial-last-batch-loss-reduced": (["--backend", "tf"], "tf_session37.py", ["--partial"], "tensorflow"),
    "horovod-elastic-api-commit-every-5": (["--backend", "horovod"], "hvd_session37.py", ["--elastic"], "horovod"),
    "horovod-sum-op": (["--backend", "horovod"], "hvd_session37.py", ["--sum-op"], "horovod"),
    "horovod-synchronize-trust-ratio-adamw": (["--backend", "horovod"], "hvd_session37.py", ["--lamb-like"], "horovod"),
    "ddp-two-views-simclr": ([], "ddp_session38.py", ["--two-views"], "torch"),
    "ddp-clip-gather-in-the-loss": ([], "ddp_session38.py", ["--clip-gather"], "torch"),
    "ddp-moe-all-to-all-experts-ignored": ([], "ddp_session38.py", ["--moe"], "torch"),
    "ddp-rank0-logging-each-step": ([], "ddp_session38.py", ["--rank0-logging"], "torch"),
    "ddp-barrier-each-step": ([], "ddp_session38.py", ["--barrier-each-step"], "torch"),
    "ddp-straggler-rank1-input": ([], "ddp_session38.py", ["--straggler"], "torch"),
    "ddp-accumulate-2-without-no-sync": ([], "ddp_session38.py", ["--accumulate-syncing", "2"], "torch"),
    "ddp-wgan-gp-generator-every-5": ([], "ddp_session38.py", ["--gradient-penalty"], "torch"),
    "ddp-of-a-compiled-module": ([], "ddp_session38.py", ["--compile-inside"], "torch"),
    "hf-trainer-gradient-checkpointing-log-every-5": ([], "examples/hf_trainer.py",
                                                      ["--gradient-checkpointing", "--log-every", "5"], "transformers"),
    "tf-keras-fit-synchronized-batchnorm": (["--backend", "tf"], "tf_session38.py", ["--sync-bn"], "tensorflow"),
    "tf-loop-own-communication-options": (["--backend", "tf"], "tf_session38.py", ["--own-packs"], "tensorflow"),
    "tf-loop-gradients-all-reduced-by-hand": (["--backend", "tf"], "tf_session38.py", ["--aggregate-by-hand"],
                                              "tensorflow"),
    "horovod-allgather-in-the-loss": (["--backend", "horovod"], "hvd_session38.py", ["--allgather-loss"], "horovod"),
    "horovod-sparse-embedding": (["--backend", "horovod"], "hvd_session38.py", ["--sparse-embedding"], "horovod"),
    "horovod-sparse-as-dense": (["--backend", "horovod"], "hvd_session38.py", ["--sparse-as-dense"], "horovod"),
    "horovod-predivide-factor-2": (["--backend", "horovod"], "hvd_session38.py", ["--predivide"], "horovod"),
    "ddp-weight-and-spectral-norm": ([], "ddp_session39.py", ["--parametrized"], "torch"),
    "ddp-sdpa-transformer-fused-adamw-warmup": ([], "ddp_session39.py", ["--attention"], "torch"),
    "ddp-dict-in-dict-out": ([], "ddp_session39.py", ["--dict-batches"], "torch"),
    "ddp-grads-kept-sgd-for-loop": ([], "ddp_session39.py", ["--set-to-none-false"], "torch"),
    "ddp-distributed-checkpoint-every-10": ([], "ddp_session39.py", ["--dcp-every", "10"], "torch"),
    "ddp-batch-grows-at-step-24": ([], "ddp_session39.py", ["--grow-batch-at", "24"], "torch"),
    "ddp-lightning-manual-optimization-gan": ([], "lightning_manual_gan.py", [], "lightning"),
    "ddp-torchscript-model": ([], "ddp_session39.py", ["--torchscript"], "torch"),
    "ddp-dataclass-output": ([], "ddp_session39.py", ["--dataclass-output"], "torch"),
    "horovod-torchscript-model": (["--backend", "horovod"], "hvd_session39.py", ["--torchscript"], "horovod"),
    "horovod-join-uneven-last-shard": (["--backend", "horovod"], "hvd_session39.py", ["--join-uneven"], "horovod"),
    "tf-loop-accumulate-2-in-the-step": (["--backend", "tf"], "tf_session39.py", ["--accumulate-2"], "tensorflow"),
    "tf-loop-two-optimizers": (["--backend", "tf"], "tf_session39.py", ["--two-optimizers"], "tensorflow"),
    "ddp-sam-two-passes-a-step": ([], "ddp_session40.py", ["--sam"], "torch"),
    "ddp-fp16-autocast-grad-scaler": ([], "ddp_session40.py", ["--fp16-scaler"], "torch"),
    "tensor-parallel-named-not-profiled": ([], "ddp_session40.py", ["--tensor-parallel"], "torch"),
    "pipeline-gpipe-named-not-profiled": ([], "ddp_session40.py", ["--pipeline"], "torch"),
    "ddp-spawn-loader-workers": ([], "ddp_spawn_loader.py", ["--context", "spawn"], "torch"),
    "ddp-forkserver-loader-workers": ([], "ddp_spawn_loader.py", ["--context", "forkserver"], "torch"),
    "ddp-hf-gpt2-loop": ([], "ddp_hf_loop.py", [], "transformers"),
    "ddp-hf-gpt2-loop-checkpointing": ([], "ddp_hf_loop.py", ["--checkpointing"], "transformers"),
    "ddp-hf-gpt2-loop-bf16": ([], "ddp_hf_loop.py", ["--bf16"], "transformers"),
    # session 41: the official tutorials' shapes (torch's ImageNet example, Horovod's pytorch_mnist, TensorFlow's
    # multi-worker Keras tutorial; MXNet's Gluon example: tutorial_mx_gluon.py, by hand)
    "ddp-tutorial-imagenet-shape-epochs-val-checkpoint": ([], "tutorial_ddp_cnn.py", [], "torch"),
    "horovod-tutorial-pytorch-mnist-shape": (["--backend", "horovod"], "tutorial_hvd_mnist.py", [], "horovod"),
    "tf-tutorial-multi-worker-keras-fit": (["--backend", "tf"], "tutorial_tf_mwms.py", [], "tensorflow"),
    # session 42: 8- and 2-byte gradients, a loop in a thread of the script's, torch's composable replicate()
    "ddp-float64-model": ([], "ddp_session42.py", ["--float64"], "torch"),
    "ddp-bfloat16-parameters": ([], "ddp_session42.py", ["--bf16-params"], "torch"),
    "ddp-loop-in-a-thread": ([], "ddp_session42.py", ["--thread"], "torch"),
    "ddp-composable-replicate": ([], "ddp_session42.py", ["--replicate"], "torch"),
    "horovod-loop-in-a-thread": (["--backend", "horovod"], "hvd_session42.py", ["--thread"], "horovod"),
    "horovod-float64-model": (["--backend", "horovod"], "hvd_session42.py", ["--float64"], "horovod"),
    "tf-loop-in-a-thread": (["--backend", "tf"], "tf_session42.py", ["--thread"], "tensorflow"),
    "tf-keras-fit-in-a-thread": (["--backend", "tf"], "tf_session42.py", ["--fit-thread"], "tensorflow"),
    # session 43: DDP's buffer broadcast, skipped optimizer steps, a time budget, Adafactor, bf16 compression;
    # Horovod of a compiled model and with broadcast_object; Keras fit over a generator and of MobileNetV2
    "ddp-batchnorm-broadcast-buffers": ([], "ddp_session43.py", ["--bn-buffers"], "torch"),
    "ddp-skipped-optimizer-steps": ([], "ddp_session43.py", ["--skip-steps"], "torch"),
    "ddp-time-budget": ([], "ddp_session43.py", ["--time-budget"], "torch"),
    "ddp-adafactor-tokens": ([], "ddp_session43.py", ["--adafactor"], "torch"),
    "ddp-bf16-compress-hook": ([], "ddp_session43.py", ["--bf16-hook"], "torch"),
    "horovod-compiled-model": (["--backend", "horovod"], "hvd_session43.py", ["--compiled"], "horovod"),
    "horovod-broadcast-object": (["--backend", "horovod"], "hvd_session43.py", ["--broadcast-object"], "horovod"),
    "tf-keras-fit-generator": (["--backend", "tf"], "tf_session43.py", ["--generator"], "tensorflow"),
    "tf-keras-mobilenetv2": (["--backend", "tf"], "tf_session43.py", ["--mobilenet"], "tensorflow"),
    "ddp-lightning-static-graph": ([], "ddp_trainers.py", ["--framework", "lightning", "--static-graph"], "lightning"),
    "ddp-lightning-clip-norm": ([], "ddp_trainers.py", ["--framework", "lightning", "--clip"], "lightning"),
    "hf-trainer-torch-compile-adafactor": ([], "examples/hf_trainer.py", ["--torch-compile", "--optim", "adafactor"],
                                           "transformers"),
    # session 44: per-sample gradients by torch.func (no backward call, no DDP), quantization-aware training,
    # anomaly mode, a ZeRO-2 shape by hand (reduce-scatter, all-gather), packed sequences of lengths per step;
    # Lightning Fabric's loop, manual optimization with one optimizer, a loss logged with sync_dist; PyTorch-Ignite;
    # Keras fit with global_clipnorm, with sample weights, of a two-input functional model
    "ddp-per-sample-grads-dp-sgd": ([], "ddp_session44.py", ["--per-sample"], "torch"),
    "ddp-quantization-aware-training": ([], "ddp_session44.py", ["--qat"], "torch"),
    "ddp-detect-anomaly": ([], "ddp_session44.py", ["--anomaly"], "torch"),
    "ddp-zero2-by-hand": ([], "ddp_session44.py", ["--zero-by-hand"], "torch"),
    "ddp-packed-lstm": ([], "ddp_session44.py", ["--packed-lstm"], "torch"),
    "lightning-fabric-loop": ([], "lightning_session44.py", ["--fabric"], "lightning"),
    "lightning-manual-one-optimizer-clip-scheduler": ([], "lightning_session44.py", ["--manual-one"], "lightning"),
    "lightning-log-sync-dist": ([], "lightning_session44.py", ["--sync-log"], "lightning"),
    "ignite-supervised-trainer": ([], "ignite_trainer.py", [], "ignite"),
    "ignite-parallel-context": ([], "ignite_trainer.py", ["--parallel"], "ignite"),
    "tf-keras-fit-global-clipnorm": (["--backend", "tf"], "tf_session44.py", ["--global-clipnorm"], "tensorflow"),
    "tf-keras-fit-sample-weight": (["--backend", "tf"], "tf_session44.py", ["--sample-weight"], "tensorflow"),
    "tf-keras-functional-two-inputs": (["--backend", "tf"], "tf_session44.py", ["--functional-two-inputs"],
                                       "tensorflow"),
    # session 45: gradients all-reduced by the script itself (no wrapper): the tutorial's per-parameter loop, a flat
    # buffer, async_op calls, buffers of about 1 MB, async calls from gradient hooks inside the backward; a conv net
    # with BatchNorm and Adam, an embedding bag, micro-batches accumulated before the all-reduces, a loss all-reduced
    # for logging after the step, Adam with an LR scheduler made before the first step and clipping
    "by-hand-tutorial-loop": ([], "by_hand_session45.py", ["--style", "loop"], "torch"),
    "by-hand-flat-buffer": ([], "by_hand_session45.py", ["--style", "flat"], "torch"),
    "by-hand-async-op": ([], "by_hand_session45.py", ["--style", "async"], "torch"),
    "by-hand-1mb-buffers": ([], "by_hand_session45.py", ["--style", "chunks"], "torch"),
    "by-hand-overlap-from-grad-hooks": ([], "by_hand_session45.py", ["--style", "hooks"], "torch"),
    "by-hand-conv-bn-adam": ([], "by_hand_session45.py", ["--style", "loop", "--model", "conv", "--adam"], "torch"),
    "by-hand-embedding-bag-flat": ([], "by_hand_session45.py", ["--style", "flat", "--model", "embed"], "torch"),
    "by-hand-accumulate-4": ([], "by_hand_session45.py", ["--style", "chunks", "--accumulate", "4"], "torch"),
    "by-hand-loss-logged": ([], "by_hand_session45.py", ["--style", "async", "--log-loss", "--model", "conv"],
                            "torch"),
    "by-hand-adamw-steplr-clip": ([], "by_hand_session45.py", ["--style", "loop", "--adam", "--scheduler", "--clip"],
                                  "torch"),
    "by-hand-gan-two-optimizers": ([], "by_hand_more.py", ["--gan"], "torch"),
    "by-hand-sgd-subclass-steplr": ([], "by_hand_more.py", ["--subclass"], "torch"),
    "by-hand-gradscaler-bf16": ([], "by_hand_more.py", ["--scaler-bf16"], "torch"),
    # session 46: an optimizer sharded by hand (ZeRO without a library: reduce-scatter, a shard's AdamW step,
    # all-gather), its tensor and list forms, groups of about 1 MB on a conv net; a U-Net with GroupNorm and a frozen
    # stem; a bidirectional GRU tagger with a large dense embedding and Adagrad
    "zero-by-hand-tensor": ([], "zero_by_hand.py", ["--style", "tensor"], "torch"),
    "zero-by-hand-list": ([], "zero_by_hand.py", ["--style", "list"], "torch"),
    "zero-by-hand-groups-conv": ([], "zero_by_hand.py", ["--style", "groups", "--model", "conv"], "torch"),
    "ddp-unet-groupnorm-frozen-stem": ([], "examples/unet_groupnorm.py", ["--freeze-stem"], "torch"),
    "ddp-gru-tagger-adagrad": ([], "examples/gru_tagger.py", [], "torch"),
    # session 47: current PyTorch's ways: DDP given a device mesh (OneCycle, Nesterov, clipping), torch's Muon with
    # AdamW, a group made without a backend, launched with torchrun's agent flags of torch 2.13
    "ddp-device-mesh-onecycle-nesterov-clip": ([], "ddp_session47.py", ["--mesh"], "torch"),
    "ddp-muon-and-adamw-cosine": ([], "ddp_session47.py", ["--muon"], "torch"),
    "ddp-no-backend-virtual-local-rank": (["--virtual-local-rank", "--shutdown-timeout", "3"], "ddp_session47.py",
                                          ["--no-backend"], "torch"),
    # session 48: FSDP2 on the CPU (profiled from this session on), shapes not tuned for, and the examples sharded
    "fsdp-conv-bn-clip-adamw-cosine": ([], "fsdp_shapes.py", ["--clip"], "torch"),
    "fsdp-transformer-no-reshard-sgd": ([], "fsdp_shapes.py", ["--no-reshard"], "torch"),
    "fsdp-frozen-embedding-adam": ([], "fsdp_shapes.py", ["--frozen-embedding"], "torch"),
    "fsdp-mlp-bf16-params": ([], "fsdp_shapes.py", ["--bf16-params"], "torch"),
    "fsdp-unet-groupnorm": ([], "examples/unet_groupnorm.py", ["--fsdp"], "torch"),
    "fsdp-gru-tagger": ([], "examples/gru_tagger.py", ["--fsdp"], "torch"),
    # session 49: FSDP2 shapes beyond one forward and backward a step
    "fsdp-accumulate-2-no-sync-first": ([], "session49.py", ["--fsdp-accumulate"], "torch"),
    "fsdp-activation-checkpointing": ([], "session49.py", ["--fsdp-checkpoint"], "torch"),
    "fsdp-root-only-conv-adagrad": ([], "session49.py", ["--fsdp-root-only"], "torch"),
    "fsdp-explicit-prefetch-rmsprop": ([], "session49.py", ["--fsdp-prefetch"], "torch"),
    "fsdp-eval-every-5": ([], "session49.py", ["--fsdp-eval"], "torch"),
    "fsdp-hf-gpt2-tied-adamw-warmup": ([], "session49.py", ["--fsdp-gpt2"], "transformers"),
    "fsdp-compiled-blocks": ([], "session49.py", ["--fsdp-compile"], "torch"),
    # session 51
    "ddp-save-on-cpu-adamw": ([], "ddp_session51.py", ["--save-on-cpu"], "torch"),
    "ddp-compiled-optimizer-step": ([], "ddp_session51.py", ["--compiled-step"], "torch"),
    "ddp-reduce-lr-on-plateau-validation": ([], "ddp_session51.py", ["--plateau"], "torch"),
    "ddp-custom-autograd-function-rmsprop": ([], "ddp_session51.py", ["--custom-function"], "torch"),
    "ddp-swa-update-bn": ([], "ddp_session51.py", ["--swa"], "torch"),
    "ddp-async-checkpoint-every-10": ([], "ddp_session51.py", ["--async-checkpoint"], "torch"),
    "ddp-scripts-own-module-hooks": ([], "ddp_session51.py", ["--backward-hook"], "torch"),
    "tf-keras-transformer-adamw-warmup": (["--backend", "tf"], "tf_session51.py", ["--transformer"], "tensorflow"),
    "horovod-grouped-allreduce-by-hand": (["--backend", "horovod"], "hvd_session51.py", ["--grouped"], "horovod"),
    "horovod-allreduce-async-by-hand": (["--backend", "horovod"], "hvd_session51.py", ["--async-after"], "horovod"),
    "horovod-allreduce-async-in-grad-hooks": (["--backend", "horovod"], "hvd_session51.py", ["--async-hooks"],
                                              "horovod"),
    "horovod-reducescatter-allgather-by-hand": (["--backend", "horovod"], "hvd_session51.py", ["--reducescatter"],
                                                "horovod"),
    # session 52
    "ddp-own-optimizer-class-lion": ([], "ddp_session52.py", ["--own-optimizer"], "torch"),
    "ddp-sgd-in-place-no-optimizer": ([], "ddp_session52.py", ["--manual-sgd"], "torch"),
    "ddp-monitored-barrier-every-10": ([], "ddp_session52.py", ["--monitored-barrier"], "torch"),
    "ddp-bf16-trunk-fp32-head": ([], "ddp_session52.py", ["--mixed-dtype"], "torch"),
    "ddp-trained-in-eval-mode": ([], "ddp_session52.py", ["--eval-mode"], "torch"),
    "tf-keras-adam-ema": (["--backend", "tf"], "tf_session52.py", ["--ema"], "tensorflow"),
    "tf-loop-lookahead-by-hand": (["--backend", "tf"], "tf_session52.py", ["--lookahead-loop"], "tensorflow"),
    "tf-loop-trained-in-inference-mode": (["--backend", "tf"], "tf_session52.py", ["--inference-mode-loop"],
                                          "tensorflow"),
    "horovod-frozen-trunk-adamw": (["--backend", "horovod"], "hvd_session52.py", ["--frozen-trunk"], "horovod"),
    "horovod-dynamic-branch": (["--backend", "horovod"], "hvd_session52.py", ["--dynamic-branch"], "horovod"),
    "horovod-trunk-frozen-mid-run": (["--backend", "horovod"], "hvd_session52.py", ["--frozen-after"], "horovod"),
    "horovod-trained-in-eval-mode": (["--backend", "horovod"], "hvd_session52.py", ["--eval-mode"], "horovod"),
    # one process launched, the ranks spawned by the script (session 53)
    "ddp-tutorial-mp-spawn-own-port": (["-np", "1"], "ddp_spawned.py", ["--tutorial"], "torch"),
    "ddp-mp-spawn-tcp-init-conv-adam": (["-np", "1"], "ddp_spawned.py", ["--tcp"], "torch"),
    "ddp-mp-fork-setdefault-address-adamw": (["-np", "1"], "ddp_spawned.py", ["--fork"], "torch"),
    "ddp-tutorial-mp-process-gradients-by-hand": (["-np", "1"], "ddp_spawned.py", ["--process"], "torch"),
    "ddp-mp-process-fork-gradients-by-hand": (["-np", "1"], "ddp_spawned.py", ["--process-fork"], "torch"),
    "ddp-torch-elastic-api-from-the-script": (["-np", "1"], "ddp_spawned.py", ["--elastic-api"], "torch"),
    "ddp-own-launcher-subprocess-ranks": (["-np", "1"], "ddp_spawned.py", ["--subprocess-launcher"], "torch"),
    "ddp-torchrun-main-from-the-script": (["-np", "1"], "ddp_spawned.py", ["--torchrun-main"], "torch"),
    "lightning-ddp-spawn-adam": (["-np", "1"], "spawned_trainers.py", ["--lightning-ddp-spawn"], "lightning"),
    "lightning-ddp-notebook-fork-sgd": (["-np", "1"], "spawned_trainers.py", ["--lightning-ddp-notebook"],
                                        "lightning"),
    "ignite-parallel-nproc-per-node-2": (["-np", "1"], "spawned_trainers.py", ["--ignite-nproc"], "ignite"),
    "accelerate-notebook-launcher": (["-np", "1"], "spawned_trainers.py", ["--accelerate-notebook"], "accelerate"),
    # scripts that copy the model they train (session 54)
    "ddp-ema-averagedmodel-of-ddp": ([], "copies_session54.py", ["--ema-of-ddp"], "torch"),
    "ddp-deepcopy-best-and-torch-save-whole": ([], "copies_session54.py", ["--snapshot"], "torch"),
    "horovod-ema-averagedmodel": (["--backend", "horovod"], "copies_session54.py", ["--horovod", "--ema"],
                                  "horovod"),
    "horovod-deepcopy-best-and-torch-save-whole": (["--backend", "horovod"], "copies_session54.py",
                                                   ["--horovod", "--save-whole"], "horovod"),
    "ddp-fp16-comm-hook-registered-at-step-10": ([], "ddp_session54.py", ["--late-comm-hook"], "torch"),
    "ddp-fp16-comm-hook-registered-at-step-40": ([], "ddp_session54.py", ["--late-comm-hook", "--late", "40"],
                                                 "torch"),
    "ddp-nanogpt-require-backward-grad-sync-accumulate-4": ([], "ddp_session55.py", ["--nanogpt"], "torch"),
    "ddp-builtin-fp16-hook-registered-at-step-10": ([], "ddp_session55.py", ["--late-builtin-hook"], "torch"),
    "ddp-tensorboard-add-graph-in-the-window": ([], "ddp_session55.py", ["--tensorboard-graph"], "torch"),
    "ddp-frozen-trunk-rewrapped-after-4-steps": ([], "session56.py", ["--rewrap"], "torch"),
    "ddp-frozen-trunk-20kb-bucket": ([], "session56.py", ["--frozen-head"], "torch"),
    "tf-keras-fit-called-per-epoch": (["--backend", "tf"], "session56.py", ["--tf-fit-loop"], "tensorflow"),
    "ddp-wgan-gp-gradient-penalty-double-backward": ([], "session57.py", ["--gradient-penalty"], "torch"),
    "ddp-experts-routed-per-rank-find-unused": ([], "session57.py", ["--experts"], "torch"),
    "ddp-weight-norm-parametrizations-and-pruning": ([], "session57.py", ["--parametrized"], "torch"),
    "ddp-fault-tolerant-snapshot-max-restarts-2": (["--max-restarts", "2"], "session58.py",
                                                   ["--fault-tolerant", "--steps", "60"], "torch"),
    "ddp-moco-shuffle-bn-momentum-encoder-queue": ([], "session58.py", ["--moco"], "torch"),
    "ddp-preemptible-own-sigterm-handler-adamax": ([], "session58.py", ["--preemptible"], "torch"),
    "ddp-message-passing-graphs-of-varying-size": ([], "session58.py", ["--gnn"], "torch"),
    "ddp-speech-conv-bigru-ctc-loss-varying-lengths": ([], "session58.py", ["--ctc"], "torch"),
    "ddp-halo-exchange-batch-isend-irecv": ([], "session59.py", ["--halo"], "torch"),
    "ddp-vmap-ensemble-of-8-stacked-mlps": ([], "session59.py", ["--ensemble"], "torch"),
    "ddp-iterable-stream-sharded-by-rank-and-worker": ([], "session59.py", ["--stream"], "torch"),
    "ddp-diffusion-denoiser-ema-loss-reduced-to-rank-0": ([], "session59.py", ["--diffusion"], "torch"),
    # session 60: Lightning's default launch from one process (strategy "ddp": the script started again as rank 1)
    "lightning-ddp-subprocess-script-adam": (["-np", "1"], "spawned_trainers.py", ["--lightning-ddp"], "lightning"),
    "fabric-ddp-subprocess-script-conv-adamw": (["-np", "1"], "spawned_trainers.py", ["--fabric-ddp"], "lightning"),
    # session 62: micro-batch counts per step from a token budget, DDP over the script's own group, truncated BPTT,
    # lazy modules materialised before DDP, an encoder and a decoder trained on alternate steps
    "ddp-token-budget-1-to-3-micro-batches-a-step": ([], "session62.py", ["--token-budget"], "torch"),
    "ddp-over-the-scripts-own-group-loss-on-world": ([], "session62.py", ["--subgroup"], "torch"),
    "ddp-tbptt-lstm-carried-state-warm-restarts": ([], "session62.py", ["--tbptt"], "torch"),
    "ddp-lazy-modules-materialised-before-ddp": ([], "session62.py", ["--lazy"], "torch"),
    "ddp-encoder-decoder-trained-on-alternate-steps": ([], "session62.py", ["--alternating"], "torch"),
    # two step functions called in turn are one iteration (as a GAN's): 80 calls for 40 iterations
    "tf-loop-encoder-decoder-step-functions-in-turn": (["--backend", "tf"], "tf_session62.py",
                                                       ["--alternating-loop", "--steps", "80"], "tensorflow"),
    "tf-loop-tbptt-lstm-state-carried-per-replica": (["--backend", "tf"], "tf_session62.py", ["--tbptt-loop"],
                                                     "tensorflow"),
    "ddp-pgd-adversarial-3-attack-steps-no-sync": ([], "session62.py", ["--pgd"], "torch"),
    "tf-keras3-custom-loop-adam": (["--backend", "tf"], "tf_session62.py", ["--keras3-loop"], "tensorflow"),
    # session 63: a backbone unfrozen in the window (gradients averaged by hand), layer-wise learning-rate decay,
    # learned task weights outside the DDP model, a batch size per rank, 1 MB buckets, Adam stepped with a closure,
    # LayerDrop averaged by hand
    "by-hand-backbone-unfrozen-at-step-8": ([], "session63.py", ["--unfreeze"], "torch"),
    "ddp-transformer-layerwise-lr-decay-warmup-cosine": ([], "session63.py", ["--llrd"], "torch"),
    "ddp-multitask-learned-loss-weights-outside-ddp": ([], "session63.py", ["--task-weights"], "torch"),
    "ddp-batch-size-per-rank-32-and-64": ([], "session63.py", ["--uneven-batches"], "torch"),
    "ddp-1mb-buckets-12mb-mlp": ([], "session63.py", ["--small-buckets"], "torch"),
    "ddp-adam-stepped-with-a-closure": ([], "session63.py", ["--closure-adam"], "torch"),
    "by-hand-layerdrop-calls-vary-per-step": ([], "session63.py", ["--layerdrop"], "torch"),
    # session 64
    "ddp-find-unused-trunk-frozen-at-step-12": ([], "session64.py", ["--freeze-midrun"], "torch"),
    "ddp-complex-valued-spectral-filters": ([], "session64.py", ["--complex"], "torch"),
    "ddp-join-zero-rank1-6-steps-short": ([], "session64.py", ["--join-zero"], "torch"),
    "by-hand-multi-grad-hook-async-per-layer": ([], "session64.py", ["--multi-grad-hook"], "torch"),
    "ddp-batchnorm-stats-all-reduced-by-hand-every-5": ([], "session64.py", ["--bn-by-hand"], "torch"),
    "by-hand-top1pct-all-gather-error-feedback": ([], "session64.py", ["--topk"], "torch"),
    "by-hand-local-sgd-parameters-averaged-every-4": ([], "session64.py", ["--local-sgd"], "torch"),
    "horovod-process-sets-metric-per-rank-set": (["--backend", "horovod"], "hvd_session64.py", ["--process-set"],
                                                 "horovod"),
    "horovod-local-sgd-parameters-averaged-every-4": (["--backend", "horovod"], "hvd_session64.py",
                                                      ["--average-every-4"], "horovod"),
    "horovod-top1pct-allgather-error-feedback": (["--backend", "horovod"], "hvd_session64.py", ["--topk"],
                                                 "horovod"),
    "tf-keras-fit-validation-split-lr-scheduler": (["--backend", "tf"], "tf_session64.py",
                                                   ["--lr-schedule-validation-split"], "tensorflow"),
    "tf-loop-persistent-tape-two-optimizers": (["--backend", "tf"], "tf_session64.py",
                                               ["--two-optimizers-persistent-tape"], "tensorflow"),
    "tf-keras-fit-masked-lstm": (["--backend", "tf"], "tf_session64.py", ["--masked-lstm-fit"], "tensorflow"),
    "tf-keras-own-train-step-two-optimizers": (["--backend", "tf"], "tf_session65.py",
                                               ["--train-step-two-optimizers"], "tensorflow"),
    "tf-loop-loss-scale-optimizer-mixed-float16": (["--backend", "tf"], "tf_session65.py", ["--loss-scale-loop"],
                                                   "tensorflow"),
    "tf-loop-sparse-embedding-adagrad-dense-adam": (["--backend", "tf"], "tf_session65.py",
                                                    ["--embedding-two-optimizers"], "tensorflow"),
    "tf-loop-contrastive-all-gather-of-embeddings": (["--backend", "tf"], "tf_session65.py", ["--gather-contrastive"],
                                                     "tensorflow"),
}
CHECK = re.compile(r"replay of the job as it ran \(([0-9.]+) ms\) (agrees with|differs from) the run's \d+ clean "
                   r"iterations \(([0-9.]+) ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated job names")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(JOBS)
    agree = checked = 0
    print("| job | replay ms | clean ms | difference | self-check |\n|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            options, script, script_args, needs = JOBS[name]
            if importlib.util.find_spec(needs) is None:
                print(f"| {name} | - | - | - | skipped: {needs} is not installed |", flush=True)
                continue
            path = os.path.join(REPO, script) if "/" in script else os.path.join(SHAPES, script)
            ranks = [] if "-np" in options else ["-np", "2"]
            cmd = [sys.executable, "-m", "dprorun.cli", "--run-dir", os.path.join(tmp, name), *options, *ranks,
                   "python", path, "--steps", str(args.steps), *script_args]
            out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600,
                                 env=dict(os.environ, DPRO_REPORT="0"))
            found = CHECK.search(out.stdout + out.stderr)
            if out.returncode != 0 or not found:
                print(f"| {name} | - | - | - | exit {out.returncode}, no self-check |", flush=True)
                checked += 1
                continue
            replay, verdict, clean = float(found.group(1)), found.group(2), float(found.group(3))
            checked += 1
            agree += verdict == "agrees with"
            if verdict == "agrees with":
                verdict = "agrees"
            else:
                verdict = "uncertain (warned)" if "but within the replay's" in out.stdout + out.stderr else \
                    "differs (warned)"
            print(f"| {name} | {replay:.2f} | {clean:.2f} | {100 * (replay / clean - 1):+.1f} % | {verdict} |",
                  flush=True)
    print(f"self-check: {agree} of {checked} agree")


if __name__ == "__main__":
    main()
