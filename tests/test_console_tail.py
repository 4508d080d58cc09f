"""The ranks' output on dprorun's console (dprorun/console_tail.py): lines as torch elastic's tail wrote them, a
progress bar's carriage-return updates redrawn in place instead of one prefixed line each."""
import io
import threading
import time

from conftest import run_dprorun
from dprorun.console_tail import Console, split_pieces, tail_rank_log


def test_pieces_end_at_newlines_and_carriage_returns_and_a_last_return_waits_for_its_newline():
    assert split_pieces("a\nb\r\nc\rd") == ([("a", "\n"), ("b", "\n"), ("c", "\r")], "d")
    assert split_pieces("bar 1\r") == ([], "bar 1\r")  # a "\n" may follow: "\r\n" is one line end
    assert split_pieces("\rbar 1\rbar 2") == ([("", "\r"), ("bar 1", "\r")], "bar 2")


def _tail_in_a_thread(path, console, dst, header="[rank0]: "):
    finished = threading.Event()
    thread = threading.Thread(target=tail_rank_log, args=(console, header, str(path), dst, finished, 0.01))
    thread.start()
    return finished, thread


def test_a_bar_is_redrawn_in_place_and_its_last_state_ends_its_line(tmp_path):
    """tqdm's stream ("\\r" + the bar, each update; "\\n" at its close), written as a rank writes it: the console gets
    the bar drawn once per state seen, each over the last ("\\r" + prefix), and no line per update."""
    path = tmp_path / "stderr.log"
    dst = io.StringIO()
    finished, thread = _tail_in_a_thread(path, Console(), dst)
    with open(path, "w") as log:
        log.write("starting\n")
        for step in range(4):
            log.write(f"\rtrain {step}/4")
            log.flush()
            time.sleep(0.1)
        log.write("\rtrain 4/4\n")
        log.write("done\n")
    time.sleep(0.1)
    finished.set()
    thread.join(timeout=10)
    text = dst.getvalue()
    assert text.startswith("[rank0]: starting\n[rank0]: train 0/4\r[rank0]: train 1/4\r"), repr(text)
    assert text.endswith("\r[rank0]: train 4/4\n[rank0]: done\n"), repr(text)
    assert text.count("\n") == 3  # torch elastic's text-mode tail: a line for each of the 5 updates, 7 lines


def test_a_line_of_another_rank_goes_below_an_open_bar_and_a_file_read_at_once_keeps_the_last_state(tmp_path):
    console = Console()
    out, err = io.StringIO(), io.StringIO()
    console.redraw(err, "[rank0]: ", "bar 3/9")
    console.line(err, "[rank1]: ", "loss 0.3")  # below rank 0's open bar, never on it
    console.redraw(err, "[rank0]: ", "bar 4/9")
    console.line(out, "[rank1]: ", "on stdout")  # another stream: the bar's line ended on its own
    console.line(err, "[rank0]: ", "bar 4/9")  # the bar's close, its last state: on its line already
    console.line(err, "[rank0]: ", "next")
    assert err.getvalue() == "[rank0]: bar 3/9\n[rank1]: loss 0.3\n[rank0]: bar 4/9\n[rank0]: next\n"
    assert out.getvalue() == "[rank1]: on stdout\n"
    path = tmp_path / "whole.log"
    path.write_text("a\r\nb\rbar 1\rbar 2\rbar 3\nlast")  # written before the tail starts: read in one chunk
    dst = io.StringIO()
    finished = threading.Event()
    finished.set()
    tail_rank_log(Console(), "[r]: ", str(path), dst, finished, 0.01,
                  log_line_filter=lambda line: not line.startswith("b\n"), a_later_torchs_option=True)
    assert dst.getvalue() == "[r]: a\n[r]: bar 3\n[r]: last\n"  # overwritten updates skipped; the unended last kept


PROGRESS_SCRIPT = """
import sys, time
import torch, torch.distributed as dist, torch.nn as nn
dist.init_process_group("gloo")
model = nn.parallel.DistributedDataParallel(nn.Linear(32, 32))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(30):
    opt.zero_grad(); model(torch.randn(8, 32)).sum().backward(); opt.step()
    if dist.get_rank() == 0:  # a progress bar as tqdm draws it
        sys.stderr.write(f"\\rtrain {step + 1}/30"); sys.stderr.flush()
    time.sleep(0.02)
if dist.get_rank() == 0:
    sys.stderr.write("\\n")
print("finished", dist.get_rank(), flush=True)
dist.destroy_process_group()
"""


def test_a_ranks_progress_bar_stays_one_line_on_the_console(tmp_path):
    """30 updates of rank 0's bar were 30 prefixed lines on dprorun's stderr (plain torchrun, teeing nothing,
    leaves the bar in place); now the bar's states are redrawn over each other, its last one ends its line."""
    script = tmp_path / "progress.py"
    script.write_text(PROGRESS_SCRIPT)
    proc, _ = run_dprorun(["-np", "2", "-q", "--warmup", "2", "--active", "4", "--clean", "2", "python", str(script)],
                          tmp_path / "run", timeout=120, carriage_returns=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    bar_lines = [line for line in proc.stderr.split("\n") if "train " in line]
    # the bar's line, where the hooks' two notes broke it, and where rank 0's "finished" on stdout, tailed apart from
    # its stderr, came before the bar's last states
    assert 1 <= len(bar_lines) <= 4, bar_lines
    assert bar_lines[-1].endswith("[rank0]: train 30/30"), bar_lines[-1][-200:]
    assert "\r[rank0]: train " in proc.stderr
    assert "[rank0]: finished 0" in proc.stdout and "[rank1]: finished 1" in proc.stdout
