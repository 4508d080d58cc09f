"""The ranks' output on dprorun's console, rank-prefixed, with progress bars redrawn in place.

torch elastic tees each rank's log file to the console line by line (`tail_log.tail_logfile`), reading it in text
mode, where a carriage return ends a line: a tqdm bar (each update "\\r" + the bar, as Lightning's, the Hugging Face
Trainer's and most scripts' progress bars write) came out as one prefixed line per update, a training of 1,000 steps
1,000 lines and more, where plain torchrun (which tees nothing) leaves the bar redrawn in place. `tail_rank_log`
takes its place for the launches of one dprorun (`output_redrawn_in_place`): a line ended by "\\n" is written as
before, a text after a "\\r" that nothing ended yet is drawn in place ("\\r" + prefix + text, no newline), the
updates a later one overwrote before it was drawn are skipped, and one rank's line never lands on another rank's
open bar (`Console`: one lock, the bar left open). The rank's log file keeps every byte.
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Iterator, Optional, TextIO

LONGEST_UNENDED = 65536  # characters of a text with no line end yet written as a line of its own


class Console:
    """Where the ranks' tails write (stdout and stderr, often one terminal): one lock, and the bar left open (its
    destination, prefix and text), so that a line goes below another rank's bar and over its own; a bar whose line
    another's ended is not written again as its own line ends with the same text."""

    def __init__(self):
        self.lock = threading.Lock()
        self.open: Optional[tuple[TextIO, str, str]] = None
        self.ended_by_another: Optional[tuple[TextIO, str, str]] = None

    def line(self, dst: TextIO, prefix: str, text: str) -> None:
        with self.lock:
            if self.ended_by_another == (dst, prefix, text):  # its last state already stands on its own line
                self.ended_by_another = None
                return
            dst.write(self._lead(dst, prefix) + prefix + text + "\n")
            self.open = None
            dst.flush()

    def redraw(self, dst: TextIO, prefix: str, text: str) -> None:
        with self.lock:
            dst.write(self._lead(dst, prefix) + prefix + text)
            self.open = (dst, prefix, text)
            dst.flush()

    def _lead(self, dst: TextIO, prefix: str) -> str:
        """"\r" over this prefix's own open bar; below another's (its line ended where it is drawn)."""
        if self.open is None:
            return ""
        if self.open[:2] == (dst, prefix):
            return "\r"
        self.ended_by_another = self.open
        other = self.open[0]
        if other is not dst:
            other.write("\n")
            other.flush()
            return ""
        return "\n"


def split_pieces(buffer: str) -> tuple[list[tuple[str, str]], str]:
    """(pieces, the rest): each piece (text, "\\n" or "\\r") ended by a line end ("\\r\\n" is one "\\n"), the rest
    unended. A "\\r" last in the buffer stays in the rest: a "\\n" may follow it."""
    pieces = []
    start = 0
    i = 0
    while i < len(buffer):
        char = buffer[i]
        if char == "\n":
            pieces.append((buffer[start:i], "\n"))
            start = i = i + 1
        elif char == "\r":
            if i + 1 == len(buffer):
                break
            if buffer[i + 1] == "\n":
                pieces.append((buffer[start:i], "\n"))
                start = i = i + 2
            else:
                pieces.append((buffer[start:i], "\r"))
                start = i = i + 1
        else:
            i += 1
    return pieces, buffer[start:]


def tail_rank_log(console: Console, header: str, file: str, dst: TextIO, finished: threading.Event,
                  interval_sec: float, log_line_filter: Optional[Callable[[str], bool]] = None, **later) -> None:
    """torch elastic's `tail_logfile` (its arguments after `console`, the launch's), with carriage returns redrawing
    in place (this module's docstring). `later`: arguments a later torch may add, left aside rather than the rank's
    output lost to a TypeError in the tail's thread."""
    import os

    def wanted(text: str) -> bool:
        return log_line_filter is None or bool(log_line_filter(text + "\n"))

    while not os.path.exists(file):
        if finished.is_set():
            return
        time.sleep(interval_sec)
    pending = ""  # the text after the last line end, unended yet
    drawn = ""  # what of it is on the console now
    with open(file, errors="replace", newline="") as handle:
        while True:
            chunk = handle.read(LONGEST_UNENDED)
            if chunk:
                pieces, pending = split_pieces(pending + chunk)
                for text, end in pieces:
                    if end == "\n":
                        drawn = ""
                        if wanted(text):
                            console.line(dst, header, text)
                if len(pending) >= LONGEST_UNENDED:
                    console.line(dst, header, pending)
                    pending = drawn = ""
                continue
            current = pending.rstrip("\r")
            if finished.is_set():
                if current and wanted(current):
                    console.line(dst, header, current)
                return
            if current and current != drawn and wanted(current):
                console.redraw(dst, header, current)
                drawn = current
            time.sleep(interval_sec)


@contextlib.contextmanager
def output_redrawn_in_place(stdout_to_stderr: bool = False) -> Iterator[None]:
    """torch elastic's log tail replaced by `tail_rank_log` for the launches inside (restored after).
    `stdout_to_stderr` (`--json`): the ranks' stdout is teed to stderr, leaving stdout to the summary's JSON."""
    try:
        from torch.distributed.elastic.multiprocessing import tail_log
    except ImportError:  # no torch elastic: nothing tees
        yield
        return
    import sys

    console = Console()

    def tail(*args, **kwargs):  # TailLog passes its arguments by name
        if stdout_to_stderr and kwargs.get("dst") is sys.stdout:
            kwargs["dst"] = sys.stderr
        tail_rank_log(console, *args, **kwargs)

    original = tail_log.tail_logfile
    tail_log.tail_logfile = tail
    try:
        yield
    finally:
        tail_log.tail_logfile = original
