"""Optimizer search time on a synthetic ResNet-50-shaped job (161 tensors, 25.6M parameters, measured as one
bucket; 30 ms forward, 60 ms backward) for one world size and several networks.

usage: python benchmarks/optimize_speed.py [--np 16] [--bandwidths 1,10,100]
Last line: the search time of the 16-rank graph (goal: <= 60 s) and its predicted gain over the default.
"""
import argparse

from dprorun.optimize import optimize
from dprorun.synth import resnet50_job_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=16)
    parser.add_argument("--bandwidths", default="1,10,100", help="Gbit/s")
    args = parser.parse_args()
    print(f"{'ranks':>5} {'Gbit/s':>6} {'default ms':>10} {'strategy ms':>11} {'gain':>6} {'replays':>7} "
          f"{'rounds':>6} {'search s':>8}  decisions")
    worst = 0.0
    gains = []
    for bw in (float(b) for b in args.bandwidths.split(",")):
        strategy = optimize(resnet50_job_model(args.np, bandwidth_gbit=bw))
        s = strategy.search
        gain = 100 * (1 - strategy.predicted_ms / strategy.baseline_ms)
        gains.append(gain)
        worst = max(worst, s["seconds"])
        print(f"{args.np:5d} {bw:6g} {strategy.baseline_ms:10.1f} {strategy.predicted_ms:11.1f} {gain:5.1f}% "
              f"{s['evaluations']:7d} {s['rounds']:6d} {s['seconds']:8.2f}  "
              + "; ".join(d.choice for d in strategy.decisions), flush=True)
    print(f"search of a {args.np}-rank ResNet-50-shaped job: at most {worst:.1f} s; predicted gain "
          f"{min(gains):.1f}-{max(gains):.1f} % over DDP's default buckets")


if __name__ == "__main__":
    main()
