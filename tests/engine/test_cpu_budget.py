"""The engine's thread count from the affinity mask and the cgroup CPU quota, on fake trees."""
from pathlib import Path

from triton_backend.engine.cpu_budget import available_cores, cgroup_quota, cpu_budget

V1_MOUNTS = (
    "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
    "32 31 0:29 {root} /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct\n"
    "34 31 0:31 / /sys/fs/cgroup/cpuset rw,relatime - cgroup cgroup rw,cpuset\n"
    "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n")
V2_MOUNTS = "30 23 0:27 {root} /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"


def _write(root: Path, relative: str, text: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _v1_tree(root: Path, cgroup: str, mount_root: str = "/") -> Path:
    _write(root, "proc/self/mountinfo", V1_MOUNTS.format(root=mount_root))
    _write(root, "proc/self/cgroup", f"4:cpuset:/\n3:cpu,cpuacct:{cgroup}\n0::/\n")
    return root / "sys/fs/cgroup/cpu,cpuacct"


def _v2_tree(root: Path, cgroup: str, mount_root: str = "/") -> Path:
    _write(root, "proc/self/mountinfo", V2_MOUNTS.format(root=mount_root))
    _write(root, "proc/self/cgroup", f"0::{cgroup}\n")
    return root / "sys/fs/cgroup"


def _v1_limit(directory: Path, quota: int, period: int = 100000) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "cpu.cfs_quota_us").write_text(f"{quota}\n")
    (directory / "cpu.cfs_period_us").write_text(f"{period}\n")


def test_cgroup_v2_quota_of_the_process_cgroup(tmp_path):
    mount = _v2_tree(tmp_path, "/kubepods/pod1/c1")
    _write(mount, "cpu.max", "max 100000\n")
    _write(mount, "kubepods/pod1/c1/cpu.max", "200000 100000\n")
    budget = cpu_budget(tmp_path, affinity=8)
    assert budget.threads == 2
    assert budget.quota.cpus == 2.0 and "cpu.max of" in budget.quota.source
    assert budget.limited_by == "cgroup CPU quota"
    assert budget.describe().startswith("2 allowed here, limited by the cgroup CPU quota: 8 cores")
    assert "cgroup CPU quota 2 CPUs (cpu.max of" in budget.describe()


def test_cgroup_v1_quota_and_an_ancestors_tighter_one(tmp_path):
    mount = _v1_tree(tmp_path, "/kubepods/burstable/pod1/c1")
    _v1_limit(mount, -1)
    _v1_limit(mount / "kubepods/burstable/pod1/c1", 300000)
    _v1_limit(mount / "kubepods/burstable/pod1", 100000)  # the pod's limit binds its container
    budget = cpu_budget(tmp_path, affinity=4)
    assert budget.threads == 1
    assert budget.quota.quota_us == 100000 and budget.quota.source.endswith("pod1")


def test_a_fractional_quota_rounds_up_and_never_below_one_thread(tmp_path):
    mount = _v2_tree(tmp_path, "/c")
    _write(mount, "c/cpu.max", "150000 100000\n")
    assert cpu_budget(tmp_path, affinity=4).threads == 2
    _write(mount, "c/cpu.max", "20000 100000\n")
    assert cpu_budget(tmp_path, affinity=4).threads == 1


def test_no_limit_leaves_the_affinity_mask(tmp_path):
    mount = _v1_tree(tmp_path, "/")
    _v1_limit(mount, -1)
    budget = cpu_budget(tmp_path, affinity=2)
    assert (budget.threads, budget.quota, budget.limited_by) == (2, None, "affinity mask")
    assert budget.describe() == ("2 allowed here, limited by the affinity mask: 2 cores in the "
                                "affinity mask, no cgroup CPU quota")


def test_a_quota_above_the_affinity_mask_leaves_the_mask(tmp_path):
    mount = _v2_tree(tmp_path, "/c")
    _write(mount, "c/cpu.max", "800000 100000\n")
    budget = cpu_budget(tmp_path, affinity=3)
    assert (budget.threads, budget.limited_by) == (3, "affinity mask")


def test_a_container_mount_shows_only_its_own_cgroup(tmp_path):
    """Without a cgroup namespace the container's mount root is its own cgroup's path."""
    mount = _v2_tree(tmp_path, "/kubepods/pod1/c1", mount_root="/kubepods/pod1/c1")
    _write(mount, "cpu.max", "50000 100000\n")
    assert cpu_budget(tmp_path, affinity=2).threads == 1


def test_hybrid_host_reads_v1_when_the_unified_tree_has_no_cpu_controller(tmp_path):
    mount = _v1_tree(tmp_path, "/job")
    (tmp_path / "sys/fs/cgroup/unified").mkdir(parents=True)
    _v1_limit(mount / "job", 250000, 100000)
    assert cgroup_quota(tmp_path).cpus == 2.5
    assert cpu_budget(tmp_path, affinity=2).threads == 2


def test_nothing_mounted_means_no_quota(tmp_path):
    assert cgroup_quota(tmp_path) is None
    assert cpu_budget(tmp_path, affinity=0).threads == 1


def test_this_machine_gives_at_least_one_thread():
    assert 1 <= available_cores() <= len(__import__("os").sched_getaffinity(0))
