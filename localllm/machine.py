"""Facts about this machine that sizing decisions read: its physical cores."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def physical_cores() -> int:
    """Cores this process may run on, counting hyperthread siblings once (they do not help a memory-bound decode)."""
    allowed = _allowed_cpus()
    if sys.platform.startswith("linux"):
        cores = _linux_cores(allowed)
        if cores:
            return cores
    if sys.platform == "darwin":
        cores = _sysctl_int("hw.physicalcpu")
        if cores:
            return cores
    return max(1, len(allowed) if allowed else (os.cpu_count() or 1))


def _allowed_cpus() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set()


def _linux_cores(allowed: set[int], root: Path = Path("/sys/devices/system/cpu")) -> int:
    """Distinct (package, core) pairs among the allowed CPUs, from sysfs topology; 0 when it cannot be read."""
    seen = set()
    for cpu in allowed:
        topology = root / f"cpu{cpu}" / "topology"
        try:
            seen.add(((topology / "physical_package_id").read_text().strip(),
                      (topology / "core_id").read_text().strip()))
        except OSError:
            return 0
    return len(seen)


def _sysctl_int(name: str) -> int:
    import subprocess

    try:
        out = subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=5).stdout
        return int(out.strip())
    except (OSError, ValueError, subprocess.SubprocessError):
        return 0
