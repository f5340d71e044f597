"""hwtopo: the tiny shared hardware-topology vocabulary of mlsyskit.

Model (frozen dataclasses, SI units in field names), declarative specs (JSON/TOML), probing of this
machine, light measurements, and emulation of slower CPUs and links on one machine.
"""

from . import console, launch
from .cgroups import CGroup, CGroupUsage, cgroup_controllers
from .emulate import (
    CpuThrottle,
    Dilation,
    LinkShaper,
    ShapedWriter,
    TokenBucket,
    cgroup_available,
    cleanup_stale,
    current_dilation,
    dilate,
    pid_alive,
    remove_cgroup,
    resume_point,
    sync_point,
    throttle,
    undilate,
)
from .measure import DiskResult, MatmulResult, attach, disk_bandwidth, matmul_flops, memcpy_bandwidth
from .model import Accelerator, Cluster, Disk, Link, Machine, NumaNode
from .probe import parse_cpulist, probe, probe_cluster, usable_cpus
from .spec import (
    atomic_dir,
    atomic_file,
    atomic_write_bytes,
    atomic_write_text,
    dumps,
    from_dict,
    load,
    loads,
    save,
    to_dict,
)
from .units import (
    SpecError,
    format_bandwidth,
    format_bytes,
    format_duration,
    format_flops,
    parse_bandwidth,
    parse_bytes,
    parse_duration,
    parse_flops,
)

__version__ = "0.2.0"

__all__ = [
    "Accelerator",
    "CGroup",
    "CGroupUsage",
    "Cluster",
    "CpuThrottle",
    "Dilation",
    "Disk",
    "DiskResult",
    "Link",
    "LinkShaper",
    "Machine",
    "MatmulResult",
    "NumaNode",
    "ShapedWriter",
    "SpecError",
    "TokenBucket",
    "atomic_dir",
    "atomic_file",
    "atomic_write_bytes",
    "atomic_write_text",
    "attach",
    "cgroup_available",
    "cgroup_controllers",
    "console",
    "cleanup_stale",
    "current_dilation",
    "dilate",
    "disk_bandwidth",
    "dumps",
    "format_bandwidth",
    "format_bytes",
    "format_duration",
    "format_flops",
    "from_dict",
    "launch",
    "load",
    "loads",
    "matmul_flops",
    "memcpy_bandwidth",
    "parse_bandwidth",
    "parse_bytes",
    "parse_cpulist",
    "parse_duration",
    "parse_flops",
    "pid_alive",
    "probe",
    "probe_cluster",
    "remove_cgroup",
    "save",
    "resume_point",
    "sync_point",
    "throttle",
    "to_dict",
    "undilate",
    "usable_cpus",
    "__version__",
]
