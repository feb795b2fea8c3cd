"""How many threads this process should compute with: its affinity mask and its cgroup's CPU
quota, not the host's core count.

Under a Kubernetes CPU limit the container sees every core of the node, but the kernel's CFS
quota lets its processes run only `quota / period` cores' worth of time per period; a team of
threads sized from the core count is throttled mid-step and its barriers wait for threads that
are not allowed to run. So the engine takes min(cores in the affinity mask, ceil(quota / period)),
at least 1. The quota is read for this process's own cgroup and every ancestor up to the
hierarchy's root (a parent's limit binds its children), from cgroup v2's `cpu.max` or cgroup v1's
`cpu.cfs_quota_us` / `cpu.cfs_period_us`, both where a hybrid host mounts both. Every path is
read under `root`, so tests can hand it a fake tree. Imports no torch.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CpuBudget", "available_cores", "cpu_budget"]


@dataclass(frozen=True)
class CpuQuota:
    """A CFS bandwidth limit: `quota_us` of CPU time per `period_us`, set in `source`."""

    quota_us: int
    period_us: int
    source: str  # the file that sets it, e.g. "cpu.max of /kubepods/pod1"

    @property
    def cpus(self) -> float:
        return self.quota_us / self.period_us


@dataclass(frozen=True)
class CpuBudget:
    """The threads to compute with and why: `affinity` cores may run this process, `quota` (None:
    no limit found) caps the CPU time it gets."""

    threads: int
    affinity: int
    quota: CpuQuota | None

    @property
    def limited_by(self) -> str:
        if self.quota is not None and math.ceil(self.quota.cpus) < self.affinity:
            return "cgroup CPU quota"
        return "affinity mask"

    def describe(self) -> str:
        """One phrase for a report, e.g. "1 allowed here, limited by the cgroup CPU quota: 2
        cores in the affinity mask, cgroup CPU quota 1.5 CPUs (cpu.max of ...)"."""
        quota = ("no cgroup CPU quota" if self.quota is None
                 else f"cgroup CPU quota {self.quota.cpus:g} CPUs ({self.quota.source})")
        return (f"{self.threads} allowed here, limited by the {self.limited_by}: "
                f"{self.affinity} cores in the affinity mask, {quota}")


def _affinity() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _cgroup_paths(root: Path) -> tuple[str | None, str | None]:
    """This process's cgroup in the v2 hierarchy and in v1's `cpu` controller."""
    v2 = v1 = None
    for line in (_read(root / "proc/self/cgroup") or "").splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            v2 = path
        elif "cpu" in controllers.split(","):
            v1 = path
    return v2, v1


def _mounts(root: Path) -> list[tuple[str, str, str, set[str]]]:
    """(root within the hierarchy, mount point, fs type, super options) of each cgroup mount."""
    mounts = []
    for line in (_read(root / "proc/self/mountinfo") or "").splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        after = line.split(" - ", 1)[1].split()
        if len(after) < 3 or after[0] not in ("cgroup", "cgroup2"):
            continue
        mounts.append((fields[3], fields[4], after[0], set(after[2].split(","))))
    return mounts


def _cgroup_dirs(root: Path, mount_root: str, mount_point: str, path: str) -> list[Path]:
    """The directories of `path` and each ancestor visible under the mount, innermost first. A
    container's mount shows only its own subtree (mount root = its cgroup), so `path` is taken
    relative to the mount's root; a path outside it (another cgroup namespace) maps to the
    mount point itself."""
    base = root / mount_point.lstrip("/")
    mount_root = mount_root.rstrip("/")
    if path == mount_root or path.startswith(mount_root + "/"):
        path = path[len(mount_root):]
    else:
        path = ""
    parts = [p for p in path.split("/") if p]
    return [base.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]


def _v2_quota(directory: Path) -> CpuQuota | None:
    fields = (_read(directory / "cpu.max") or "").split()
    if len(fields) != 2 or fields[0] == "max":
        return None
    return _quota(fields[0], fields[1], "cpu.max", directory)


def _v1_quota(directory: Path) -> CpuQuota | None:
    quota = _read(directory / "cpu.cfs_quota_us")
    period = _read(directory / "cpu.cfs_period_us")
    if quota is None or period is None:
        return None
    return _quota(quota, period, "cpu.cfs_quota_us", directory)


def _quota(quota: str, period: str, name: str, directory: Path) -> CpuQuota | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    if q <= 0 or p <= 0:  # -1: no limit (v1)
        return None
    return CpuQuota(q, p, f"{name} of {directory}")


def cgroup_quota(root: Path = Path("/")) -> CpuQuota | None:
    """The tightest CPU quota over this process's cgroup and its ancestors, in the v2 hierarchy
    and v1's `cpu` controller; None when nothing limits it."""
    v2_path, v1_path = _cgroup_paths(root)
    found: list[CpuQuota] = []
    for mount_root, mount_point, fstype, options in _mounts(root):
        if fstype == "cgroup2" and v2_path is not None:
            dirs, read = _cgroup_dirs(root, mount_root, mount_point, v2_path), _v2_quota
        elif fstype == "cgroup" and "cpu" in options and v1_path is not None:
            dirs, read = _cgroup_dirs(root, mount_root, mount_point, v1_path), _v1_quota
        else:
            continue
        found.extend(q for q in map(read, dirs) if q is not None)
    return min(found, key=lambda q: q.cpus, default=None)


def cpu_budget(root: Path = Path("/"), affinity: int | None = None) -> CpuBudget:
    """Threads = min(cores in the affinity mask, ceil(quota / period)), at least 1."""
    cores = max(1, affinity if affinity is not None else _affinity())
    quota = cgroup_quota(root)
    threads = cores if quota is None else min(cores, math.ceil(quota.cpus))
    return CpuBudget(max(1, threads), cores, quota)


def available_cores() -> int:
    """Threads this process should compute with (see `cpu_budget`)."""
    return cpu_budget().threads
