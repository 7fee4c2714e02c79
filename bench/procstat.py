"""What the benchmarks read from /proc and the socket layer, and the servers they start
and stop (shared by bench/*.py).

CPU figures come from /proc (Linux): busy seconds of the whole machine and of one
process, so a benchmark can tell whether other processes were competing for the cores.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

TICK = float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0


def machine_busy_s() -> float | None:
    """CPU seconds the whole machine has spent busy (not idle, not iowait); None off Linux."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    # user nice system idle iowait irq softirq steal ...: everything but idle and iowait
    values = [int(v) for v in fields[1:9]]
    return (sum(values) - values[3] - values[4]) / TICK


def process_busy_s(pid: int) -> float:
    """utime + stime of one process, all its threads, in seconds (0 when unreadable)."""
    try:
        after_name = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(after_name[11]) + int(after_name[12])) / TICK


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_healthy(port: int, proc: subprocess.Popen[bytes], timeout_s: float = 900.0) -> None:
    """Until the server on `port` answers /health with 200 (SystemExit if it exits first)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode}) before it served")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise SystemExit("the server did not answer in time")


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Terminate a process this benchmark started, killed after 30 s."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
