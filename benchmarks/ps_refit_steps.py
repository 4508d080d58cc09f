"""How closely the PS fit lands on its reference where the link level is refitted (a noisy run's profiled transfers
replay longer than its clean iterations): one recorded `dprorun --backend mxnet` run refitted to references of
0.55-1.14 x its clean iterations (steps of 0.01), the replay of the job as it ran against each.

    python benchmarks/ps_refit_steps.py RUN_DIR

Prints a row per reference missed by over 0.3 % and, last, the worst miss. (Session 44: the bisection on the link
level alone stopped at a step of the replay, up to 4.36 % off on the suite's MLP; the compute now closes the step.)"""
import argparse
from dataclasses import replace

from dprorun.replay.engine import replay
from dprorun.replay.ps import PSWhatIf, ps_graph
from dprorun.replay.ps_model import _refit_links_to_reference, build_ps_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    parser.add_argument("--fits", type=int, default=60)
    args = parser.parse_args()
    model = build_ps_model(args.run_dir)
    print("| reference x clean | compute scale | link level | miss |\n|---|---|---|---|")
    worst = 0.0
    for step in range(args.fits):
        scale = 0.55 + 0.01 * step
        fitted = replace(model, notes=[], clean_iterations_us=[t * scale for t in model.clean_iterations_us])
        _refit_links_to_reference(fitted)
        miss = replay(ps_graph(fitted, PSWhatIf())).iteration_time_us / fitted.measured_iteration_us - 1
        worst = max(worst, abs(miss))
        if abs(miss) > 0.003:
            print(f"| {scale:.2f} | {fitted.compute_scale:.3f} | {fitted.link_level:.3f} | {100 * miss:+.2f} % |")
    print(f"worst miss over {args.fits} refits: {100 * worst:.2f} %")


if __name__ == "__main__":
    main()
