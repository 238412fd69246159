"""Facts about this machine that sizing decisions read: its physical cores."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def physical_cores() -> int:
    """Cores this process may run on, counting hyperthread siblings once (they do not help a memory-bound decode),
    and no more than its cgroup's CPU budget: threads past a container's quota are throttled every period, the
    collapse Ollama users report from containers."""
    cores = _topology_cores()
    budget = cgroup_cpu_budget() if sys.platform.startswith("linux") else None
    return min(cores, budget) if budget else cores


def _topology_cores() -> int:
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


def cgroup_cpu_budget(root: Path = Path("/sys/fs/cgroup"), membership: str | None = None) -> int | None:
    """Whole CPUs this process's cgroup lets it use (cgroup v2 `cpu.max` and `cpuset.cpus.effective`, or v1's CFS
    quota and cpuset), at least 1; None when no limit is set or none can be read. `membership` is the text of
    /proc/self/cgroup (read when not given); a quota on a parent cgroup binds too, so each path is walked up."""
    if membership is None:
        try:
            membership = Path("/proc/self/cgroup").read_text()
        except OSError:
            return None
    limits: list[float] = []
    for line in membership.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        controllers, path = set(parts[1].split(",")), parts[2].strip("/")
        if parts[0] == "0" and parts[1] == "":  # v2: one unified hierarchy
            limits += _walk_up(root, path, "cpu.max", _v2_quota)
            limits += _walk_up(root, path, "cpuset.cpus.effective", _cpu_list_count, leaf_only=True)
        elif "cpu" in controllers:
            folder = root / parts[1]
            limits += _walk_up(folder, path, "cpu.cfs_quota_us", _v1_quota)
        elif "cpuset" in controllers:
            limits += _walk_up(root / "cpuset", path, "cpuset.effective_cpus", _cpu_list_count, leaf_only=True)
    return max(1, int(min(limits))) if limits else None


def _walk_up(root: Path, path: str, name: str, parse, *, leaf_only: bool = False) -> list[float]:
    """`parse` of `name` in the cgroup at `path` under `root` and in each of its parents (a container sees its own
    cgroup at the root); only the first one found when `leaf_only` (an effective cpuset already holds the parents')."""
    found = []
    parts = [p for p in path.split("/") if p]
    for depth in range(len(parts), -1, -1):
        try:
            value = parse(root.joinpath(*parts[:depth]) / name)
        except (OSError, ValueError):
            continue
        if value is not None:
            found.append(value)
            if leaf_only:
                break
    return found


def _v2_quota(file: Path) -> float | None:
    quota, period = file.read_text().split()[:2]
    return None if quota == "max" else int(quota) / int(period)


def _v1_quota(file: Path) -> float | None:
    quota = int(file.read_text())
    return None if quota <= 0 else quota / int((file.parent / "cpu.cfs_period_us").read_text())


def _cpu_list_count(file: Path) -> float | None:
    """CPUs in a list such as `0-3,6`; None when it is empty (no cpuset set)."""
    count = 0
    for item in file.read_text().strip().split(","):
        if item:
            first, _, last = item.partition("-")
            count += int(last or first) - int(first) + 1
    return count or None


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
