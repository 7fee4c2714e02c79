"""How many torch threads a node runs by default: one per physical core it may use.

Hyperthread siblings share a core's vector units: a second thread on a sibling slows
matrix kernels down rather than up. Several nodes on one machine should each take
`--torch-threads 1` (or split the cores between them): their threads spin while waiting
and steal each other's cores (shared/notes/model.md).
"""

from __future__ import annotations

import os
from pathlib import Path

_TOPOLOGY = Path("/sys/devices/system/cpu")


def physical_cores() -> int:
    """Physical cores among the CPUs this process may run on (at least 1)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)
    cores: set[str] = set()
    for cpu in cpus:
        siblings = _TOPOLOGY / f"cpu{cpu}" / "topology" / "thread_siblings_list"
        try:
            cores.add(siblings.read_text().strip())
        except OSError:
            cores.add(f"cpu{cpu}")  # no topology: count the CPU as a core
    return max(1, len(cores))


def keep_this_thread_single_threaded() -> None:
    """Run torch ops of the calling thread without OpenMP threads of their own.

    Only the torch worker may run parallel regions. Once a second thread owns an OpenMP
    team, libgomp counts more threads than cores and stops spinning between parallel
    regions: the worker's helper threads then sleep and wake hundreds of times a token.
    Measured on 2 cores: 22 ms per token with the main thread single-threaded, 36-45 ms
    after the main (or a loading) thread had run one multi-threaded op.
    """
    import torch

    torch.set_num_threads(1)
