import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(REPO, "examples")
FIXTURES = os.path.join(os.path.dirname(REPO), "shared", "fixtures")


def fixture_path(*parts: str) -> str:
    path = os.path.join(FIXTURES, *parts)
    if not os.path.exists(path):
        pytest.skip(f"recorded fixture {os.path.join(*parts)} not available: ../shared/fixtures is absent "
                    "(it holds real GPU traces that cannot be recorded on this machine)")
    return path


class ScriptProfilerSession:
    """A stand-in for RankSession where runtime/script_profiler.py's watchers are tested: the starts and stops of the
    script's profiler they report, in order; a watcher that disables profiling fails the test."""

    def __init__(self):
        from dprorun.runtime.script_profiler import ScriptProfilerState

        self.script_profiler, self.calls = ScriptProfilerState(), []

    def script_profiler_started(self):
        self.calls.append("started")

    def script_profiler_stopped(self):
        self.calls.append("stopped")

    def disable(self, why):
        raise AssertionError(why)


def run_dprorun(args, run_dir, timeout=180, env=None, carriage_returns=False):
    """Run the real dprorun CLI in a subprocess; returns (CompletedProcess, elapsed seconds). No report.html at
    the job's end unless env asks for it (DPRO_REPORT=1): its what-if curves take up to 5 s per job, the job-end
    report has tests of its own (test_report.py's finalize test, the MXNet job's). `carriage_returns`: the output
    as written, its "\r" kept (text mode reads one as a line end)."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    full_env.setdefault("DPRO_REPORT", "0")
    cmd = [sys.executable, "-m", "dprorun.cli", "--run-dir", str(run_dir)] + list(args)
    start = time.monotonic()
    with subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=not carriage_returns) as launcher:
        try:
            stdout, stderr = launcher.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            # SIGTERM first: dprorun stops every rank or role it started (a SIGKILL would leave them running,
            # holding the cores for the rest of the suite), then the test fails on the timeout
            launcher.terminate()
            try:
                launcher.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                launcher.kill()
            raise
    if carriage_returns:
        stdout, stderr = stdout.decode(errors="replace"), stderr.decode(errors="replace")
    proc = subprocess.CompletedProcess(cmd, launcher.returncode, stdout, stderr)
    return proc, time.monotonic() - start


def start_dprorun_until(args, run_dir, until: str, timeout=120, env=None) -> subprocess.Popen:
    """The real dprorun CLI started in the background (stdout dropped, stderr piped), returned once RUN/`until`
    exists (a rank's events.json: past its window), for a test that then signals it."""
    proc = subprocess.Popen([sys.executable, "-m", "dprorun.cli", "--run-dir", str(run_dir)] + list(args), cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None and not (Path(run_dir) / until).exists():
        time.sleep(0.2)
    assert (Path(run_dir) / until).exists(), f"the job never wrote {until}: " + (
        proc.communicate()[1][-2000:] if proc.poll() is not None else "")
    return proc


def run_script_job(tmp_path, source: str, window: list, timeout=120):
    """A 2-rank dprorun job (quiet, the `window` options) of a script written from `source` into tmp_path; it must
    exit 0. Returns (CompletedProcess, run directory)."""
    script, run_dir = tmp_path / "script.py", tmp_path / "run"
    script.write_text(source)
    proc, _ = run_dprorun(["-np", "2", *window, "-q", "python", str(script)], run_dir, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc, run_dir


OWN_EXCEPTHOOK_WRAPPER = """
import os, runpy, sys
def own_hook(exc_type, exc, tb):  # as rich.traceback.install() or a logger's: the script prints its errors itself
    print("own hook:", exc_type.__name__, exc, file=sys.stderr, flush=True)
sys.excepthook = own_hook
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))  # as python does for the script it runs
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def with_own_excepthook(tmp_path, script: str) -> str:
    """A script that installs an excepthook of its own, then runs `script` with the arguments given after it."""
    wrapper = tmp_path / "own_excepthook.py"
    wrapper.write_text(OWN_EXCEPTHOOK_WRAPPER)
    return str(wrapper)


@pytest.fixture(scope="session")
def mlp_run(tmp_path_factory):
    """One real 2-rank profiled DDP job shared by the tests that only read its run directory."""
    run_dir = tmp_path_factory.mktemp("runs") / "mlp"
    proc, _ = run_dprorun(["-np", "2", "--warmup", "3", "--active", "6", "--kineto-iters", "2", "--clean", "3",
                           "python",
                           os.path.join(EXAMPLES, "mlp_many_layers.py"), "--steps", "16", "--bucket-mb", "1"],
                          run_dir)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_dir, proc


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def render_page(path, profile_dir):
    """A report page rendered by headless Chromium: (what its script says it drew, the errors it caught, the
    rendered DOM). Needs CHROMIUM."""
    import json
    import re

    proc = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                           "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic",
                           f"--user-data-dir={profile_dir}", "--virtual-time-budget=10000", "--dump-dom",
                           "file://" + os.path.abspath(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    status = re.search(r'id="render-status">([^<]*)<', proc.stdout)
    errors = re.search(r'id="render-errors">([^<]*)<', proc.stdout)
    assert status and errors, proc.stdout[-2000:]
    return json.loads(status.group(1).replace("&quot;", '"')), errors.group(1), proc.stdout
