"""How much host memory this process may still allocate (notebook 00): the machine's answer to
core/device.py's `host_bytes_free`, which the run's memory check (core/memory.py) asks before it
allocates; the model's load checks (model/checks.py) ask here directly.

Free memory is the smallest of three numbers, each of which can be the one that stops an allocation:

    MemAvailable      the machine's free memory (/proc/meminfo)
    RLIMIT_AS         an address-space limit (`ulimit -v`) minus this process's address space now
    the cgroup        a container's memory limit minus its usage (cgroup v2 memory.max, v1 limit_in_bytes),
                      not counting page cache the kernel can drop (inactive_file)

A number that cannot be read counts as no limit: a check never refuses on a guess. When an allocation
fails all the same, `shared_memory_error` turns torch's error into one that says what to lower.
"""

from __future__ import annotations

import os
import re

UNKNOWN = 2**62  # "no limit known"


def host_bytes_free() -> int:
    """Bytes of host memory this process may still allocate (the smallest of the limits above)."""
    return min(_mem_available(), _address_space_left(), _cgroup_left())


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return UNKNOWN


def _address_space_left() -> int:
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    except (ImportError, OSError, ValueError, AttributeError):
        return UNKNOWN
    if soft == resource.RLIM_INFINITY or soft < 0:
        return UNKNOWN
    try:
        with open("/proc/self/status") as f:
            used = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    except (OSError, StopIteration, ValueError, IndexError):
        used = 0
    return max(0, soft - used)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _inactive_file(stat: str | None, key: str) -> int:
    for line in (stat or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.isdigit():
            return int(value)
    return 0


def _cgroup_left() -> int:
    """A container's memory limit minus what its processes use; UNKNOWN where there is none."""
    own = ""
    for line in (_read("/proc/self/cgroup") or "").splitlines():
        if line.startswith("0::"):  # cgroup v2: this process's group, under the mount point
            own = line[3:].strip("/")
    for folder in dict.fromkeys((os.path.join("/sys/fs/cgroup", own), "/sys/fs/cgroup")):
        limit = _read(os.path.join(folder, "memory.max"))
        current = _read(os.path.join(folder, "memory.current"))
        if limit and limit.isdigit() and current and current.isdigit():
            used = int(current) - _inactive_file(_read(os.path.join(folder, "memory.stat")), "inactive_file")
            return max(0, int(limit) - max(0, used))
    limit = _read("/sys/fs/cgroup/memory/memory.limit_in_bytes")  # cgroup v1
    usage = _read("/sys/fs/cgroup/memory/memory.usage_in_bytes")
    if limit and limit.isdigit() and usage and usage.isdigit() and int(limit) < UNKNOWN:
        stat = _read("/sys/fs/cgroup/memory/memory.stat")
        used = int(usage) - _inactive_file(stat, "total_inactive_file")
        return max(0, int(limit) - max(0, used))
    return UNKNOWN


def shared_memory_error(nbytes: int, exc: RuntimeError) -> ValueError:
    """A shared-memory allocation that failed (a memory limit): remove the file torch left, say what to lower."""
    # torch names the file it created in /dev/shm and leaves it there when mmap fails after creating it
    for name in re.findall(r"<(/torch_[^<>/]+)>", str(exc)):
        try:
            os.unlink("/dev/shm" + name)
        except OSError:
            pass
    return ValueError(f"the cpu device could not allocate {nbytes / 1e9:.2f} GB of shared memory "
                      f"({' '.join(str(exc).split())}): a memory limit (ulimit -v, a container's cgroup) or a "
                      "full /dev/shm. Lower num_blocks (the KV cache) or max_batch_tokens (the IO slots)")
