"""argparse types the two command lines share: numbers that must be positive (or at least zero), refused at the
command line with the flag named, not carried into a launch or a what-if (`dpro replay --np -2` printed a 0.000 ms
prediction; `--bucket-mb -3` built "buckets of up to -3 MB"); and the launch lines' split between the launcher's
options and the training command, whose words are the script's alone."""
from __future__ import annotations

import argparse
from typing import Callable, Optional, Sequence, Union

Number = Union[int, float]


def at_least(cast: Callable[[str], Number], least: Number, strictly: bool = False) -> Callable[[str], Number]:
    """An argparse type: `cast(text)`, which must be >= least (> least where `strictly`)."""
    def parse(text: str) -> Number:
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if value < least or (strictly and value == least):
            raise argparse.ArgumentTypeError(f"{text}: must be {'above' if strictly else 'at least'} {least}")
        return value

    return parse


positive_int = at_least(int, 1)
positive_float = at_least(float, 0.0, strictly=True)
non_negative_int = at_least(int, 0)
non_negative_float = at_least(float, 0.0)


def command_start(parser: argparse.ArgumentParser, argv: Sequence[str]) -> Optional[int]:
    """Where the command (the parser's REMAINDER) begins in argv: the first word that is neither one of the
    parser's options (an unambiguous abbreviation of a long one too, as argparse reads them) nor an option's value.
    None where a `--` comes first (the command follows it) or there is no command."""
    takes_value: dict[str, Optional[str]] = {}  # option string -> its nargs (None: one value, 0: none, "?": maybe)
    for action in parser._actions:
        for option in action.option_strings:
            takes_value[option] = action.nargs
    index = 0
    while index < len(argv):
        word = argv[index]
        if word == "--":
            return None
        if not word.startswith("-") or word == "-":
            return index
        name, attached = word.split("=", 1)[0], "=" in word
        if name not in takes_value and name.startswith("--"):
            longer = [option for option in takes_value if option.startswith(name)]
            name = longer[0] if len(longer) == 1 else name
        elif name not in takes_value:  # a short option with its value attached (-np2, -Hhost1:2)
            attached = any(word.startswith(option) for option in takes_value if not option.startswith("--"))
        nargs = takes_value.get(name, 0)
        following = argv[index + 1] if index + 1 < len(argv) else "-"
        index += 2 if not attached and (nargs is None or (nargs == "?" and not following.startswith("-"))) else 1
    return None


def mark_command(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """argv with a `--` before the command where none precedes it, so that the command's words stay the
    command's: argparse matched a script's own argument against the launcher's options before the command took
    it (`dprorun -np 2 python train.py --horovod` was refused as an ambiguous abbreviation of --horovod-timeline /
    --horovodrun-flag; a plain launch hands it to the script). The parsed command then starts with `--`."""
    argv = list(argv)
    start = command_start(parser, argv)
    return argv if start is None else argv[:start] + ["--"] + argv[start:]


def parse_launch_line(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """parser.parse_args of argv with its command marked (mark_command)."""
    return parser.parse_args(mark_command(parser, argv))
