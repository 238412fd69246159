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
            seen.add(
                ((topology / "physical_package_id").read_text().strip(), (topology / "core_id").read_text().strip())
            )
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


def keep_openmp_barriers_spinning() -> None:
    """Set GNU OpenMP's waits before llama.cpp loads it (it reads them once), unless the user set them.

    llama.cpp's CPU threads meet at an OpenMP barrier after every operation of a step. libgomp spins there a while
    before sleeping, but only while it manages no more threads than the machine has CPUs; past that (another loaded
    model, a benchmark's raw loop) it spins 100 times and then sleeps at every barrier, and two threads decode slower
    than one (docs/benchmark-notes.md, "OpenMP barriers"). `active` raises that spin to 1000, enough to cross a
    barrier awake; GOMP_SPINCOUNT keeps an idle thread's spin as long as without the policy. LLVM's OpenMP reads the
    policy differently (its threads would spin forever), so only a llama.cpp linked to libgomp gets it."""
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ or not _llama_cpp_uses_libgomp():
        return
    os.environ["OMP_WAIT_POLICY"] = "active"
    os.environ["GOMP_SPINCOUNT"] = "300000"


def _llama_cpp_uses_libgomp() -> bool:
    """Whether llama-cpp-python's CPU backend names libgomp among its libraries, read without loading it."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("llama_cpp")
    except (ImportError, ValueError):
        return False
    folders = (spec.submodule_search_locations or []) if spec else []
    libs = [lib for folder in folders for lib in sorted(Path(folder, "lib").glob("libggml-cpu*.so*"))]
    try:
        return bool(libs) and b"libgomp.so" in libs[0].read_bytes()
    except OSError:
        return False
