"""Atomic, owner-only file writes: a reader never sees a half-written file."""
from __future__ import annotations

import gzip
import json
import os
import shutil
import tempfile
from typing import Any


class TraceError(Exception):
    """A file in a run directory that cannot be used; the message names the file and the problem."""

    def __init__(self, path: str, problem: str):
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


class UnanswerableError(ValueError):
    """A question the run's data cannot answer (e.g. re-bucketing without gradient-ready times): bad input for
    the command (exit 2), unlike any other ValueError, which is a defect and shows as one."""


def free_mb(path: str) -> float:
    """Free space (MB) on the filesystem holding `path` (or its nearest existing parent)."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    return shutil.disk_usage(probe).free / 1e6


def make_private_dir(path: str) -> str:
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def atomic_write_bytes(path: str, data: bytes) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    make_private_dir(directory)
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def atomic_write_json(path: str, obj: Any, indent: int | None = None) -> None:
    data = json.dumps(obj, indent=indent, separators=None if indent else (",", ":"))
    atomic_write_bytes(path, data.encode())


def read_json(path: str) -> Any:
    """Read JSON (optionally gzip'ed), turning every failure into a TraceError naming the file."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read()
    except FileNotFoundError:
        raise TraceError(path, "file is missing") from None
    except OSError as exc:
        raise TraceError(path, f"cannot be read ({exc.strerror})") from None
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as exc:
            raise TraceError(path, f"corrupted gzip data ({exc})") from None
    if not raw.strip():
        raise TraceError(path, "file is empty")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise TraceError(path, "not text (binary data where JSON was expected)") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        ends_early = exc.pos >= len(text.rstrip()) - 1 or exc.msg.startswith("Unterminated")
        where = "truncated" if ends_early or text.count("{") > text.count("}") else "corrupted"
        raise TraceError(path, f"{where} JSON at byte {exc.pos}: {exc.msg}") from None


def complete_json_objects(text: str, pos: int) -> list[dict]:
    """The complete JSON objects of a list whose text starts at `pos` (just past its "["), up to its "]" or to
    where the text was cut short (a trace file a killed job left half-written)."""
    import json

    decoder, objects = json.JSONDecoder(), []
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return objects
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return objects
        if isinstance(obj, dict):
            objects.append(obj)
