"""Declarative cluster specs: read JSON or TOML, write JSON, validate with exact field paths.

Spec keys are friendly (``memory = "16GiB"``, ``bandwidth = "10Gbps"``, ``latency = "25ms"``); the
SI field names of the model (``memory_bytes``...) are accepted too, and are what ``save`` writes,
so ``load(save(c)) == c``.

Every value is range-checked where it is read: quantities are finite, greater than zero where a
zero would be meaningless (memory, bandwidth, compute; a link's latency and a memoryless NUMA node
may be 0) and at most ``MAX_QUANTITY``; counts and CPU ids lie below ``MAX_CPUS``. A machine is
checked as a whole too: at least as many threads as cores, its NUMA nodes' CPUs among its own
(ids ``0..threads-1``, or those listed in its ``cpus``) and each CPU in one node only.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import fields
from pathlib import Path
from typing import IO, Any

from .model import Accelerator, Cluster, Disk, Link, Machine, NumaNode
from .units import SpecError, parse_bandwidth, parse_bytes, parse_duration, parse_flops

__all__ = ["load", "loads", "from_dict", "to_dict", "save", "dumps", "atomic_write_text"]

MAX_CPUS = 1 << 16  # hardware threads of one machine (Linux allows at most 8192)
MAX_QUANTITY = 1e24  # bytes, bytes/s, FLOP/s, seconds: far beyond any machine, finite for arithmetic
MAX_SPEC_BYTES = 16 << 20  # a spec is text written by people or by `save`, not a dump

Parser = Callable[[Any, str], Any]


def _str(value: Any, field: str) -> str:
    if not isinstance(value, str) or not value:
        raise SpecError(field, f"{value!r} is not a non-empty string")
    return value


def _opt_str(value: Any, field: str) -> str | None:
    return None if value is None else _str(value, field)


def _bool(value: Any, field: str) -> bool:
    if not isinstance(value, bool):
        raise SpecError(field, f"{value!r} is not a boolean; use true or false")
    return value


def _int(minimum: int, maximum: int) -> Parser:
    def parse(value: Any, field: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
            raise SpecError(field, f"{value!r} is not an integer between {minimum} and {maximum}")
        return value

    return parse


def _speed(value: Any, field: str) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= MAX_QUANTITY
    if not ok:  # also rejects NaN and infinity
        raise SpecError(field, f"{value!r} is not a finite relative speed > 0; use e.g. 1.0 (the reference) or 0.5")
    return float(value)


def _quantity(parse: Parser, example: str, zero_ok: bool = False) -> Parser:
    """A unit parser (finite, >= 0) narrowed to a physical range: > 0 unless ``zero_ok``, <= MAX_QUANTITY."""

    def wrapped(value: Any, field: str) -> float:
        v = parse(value, field)
        if v <= 0 and not zero_ok:
            raise SpecError(field, f"{value!r} must be greater than zero; use e.g. {example!r} or leave it out")
        if v > MAX_QUANTITY:
            raise SpecError(field, f"{value!r} is beyond any machine (at most {MAX_QUANTITY:g}); use e.g. {example!r}")
        return v

    return wrapped


def _cpu_ids(value: Any, field: str) -> tuple[int, ...]:
    """A list of CPU ids or a Linux cpulist string ("0-3,8"), each id below MAX_CPUS, none twice."""
    bad = SpecError(field, f"{value!r} is not a CPU list; use e.g. '0-3,8' or [0, 1]")
    if isinstance(value, str):
        parts = [p.strip() for p in value.split(",") if p.strip()]
        if not all(re.fullmatch(r"[0-9]+(-[0-9]+)?", p) for p in parts):
            raise bad
        # check the bounds before expanding ranges: "0-9999999999" must not build a huge list
        ends = [int(n) for p in parts for n in p.split("-")]
        if any(n >= MAX_CPUS for n in ends):
            raise SpecError(field, f"{value!r} names a CPU id beyond {MAX_CPUS - 1}; use e.g. '0-3,8'")
        from .probe import parse_cpulist

        try:
            ids = parse_cpulist(value)
        except ValueError:
            raise bad from None
    elif isinstance(value, list) and all(isinstance(c, int) and not isinstance(c, bool) for c in value):
        ids = value
        if any(not 0 <= c < MAX_CPUS for c in ids):
            raise SpecError(field, f"{value!r} names a CPU id outside 0-{MAX_CPUS - 1}; use e.g. [0, 1]")
    else:
        raise bad
    if len(set(ids)) != len(ids):
        raise SpecError(field, f"{value!r} names a CPU more than once; list each CPU once")
    return tuple(ids)


# For each dataclass: spec key -> (model field, parser). Keys equal to the model field are implied.
_Table = dict[str, tuple[str, Parser]]


def _table(cls: type, friendly: dict[str, tuple[str, Parser]], plain: dict[str, Parser]) -> _Table:
    table: _Table = {}
    for key, (attr, parse) in friendly.items():
        table[key] = (attr, parse)
        table[attr] = (attr, parse)
    for attr, parse in plain.items():
        table[attr] = (attr, parse)
    names = {f.name for f in fields(cls)}
    assert all(attr in names for attr, _ in table.values()), cls
    return table


_NUMA = _table(
    NumaNode,
    {
        # a memoryless node (CPUs only) is real hardware, so 0 bytes is allowed here
        "memory": ("memory_bytes", _quantity(parse_bytes, "64GiB", zero_ok=True)),
        "bandwidth": ("bandwidth_bytes_per_s", _quantity(parse_bandwidth, "20GB/s")),
    },
    {"id": _int(0, MAX_CPUS - 1), "cpus": _cpu_ids},
)
_DISK = _table(
    Disk,
    {
        "capacity": ("capacity_bytes", _quantity(parse_bytes, "2TB")),
        "read_bandwidth": ("read_bandwidth_bytes_per_s", _quantity(parse_bandwidth, "3GB/s")),
        "write_bandwidth": ("write_bandwidth_bytes_per_s", _quantity(parse_bandwidth, "2GB/s")),
    },
    {"name": _str, "path": _opt_str, "rotational": _bool},
)
_ACCEL = _table(
    Accelerator,
    {
        "memory": ("memory_bytes", _quantity(parse_bytes, "80GiB")),
        "peak": ("peak_flops", _quantity(parse_flops, "989TFLOPS")),
        "interconnect": ("interconnect_bandwidth_bytes_per_s", _quantity(parse_bandwidth, "450GB/s")),
    },
    {"kind": _str, "name": _str},
)
_MACHINE = _table(
    Machine,
    {
        "memory": ("memory_bytes", _quantity(parse_bytes, "16GiB")),
        "compute": ("flops", _quantity(parse_flops, "1.2TFLOPS")),
    },
    {
        "name": _str,
        "cpus": _cpu_ids,
        "cores": _int(1, MAX_CPUS),
        "threads": _int(1, MAX_CPUS),
        "speed": _speed,
        "region": _opt_str,
    },
)
_LINK = _table(
    Link,
    {
        "bandwidth": ("bandwidth_bytes_per_s", _quantity(parse_bandwidth, "10Gbps")),
        "latency": ("latency_s", _quantity(parse_duration, "25ms", zero_ok=True)),
    },
    {"a": _str, "b": _str, "name": _opt_str},
)


def _obj(data: Any, field: str, table: _Table, nested: dict[str, Callable] | None = None) -> dict:
    if not isinstance(data, dict):
        raise SpecError(field, f"expected a table/object, got {type(data).__name__}")
    nested = nested or {}
    out: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{field}.{key}" if field else key
        if key in nested:
            out[key] = nested[key](value, path)
        elif key in table:
            attr, parse = table[key]
            if attr in out:
                raise SpecError(path, f"given twice (as {attr!r} and {key!r}); keep one")
            if value is not None:  # null means "not given": the field keeps its default
                out[attr] = parse(value, path)
        else:
            valid = sorted(set(table) | set(nested))
            raise SpecError(path, f"unknown field {key!r}; valid fields are {', '.join(valid)}")
    return out


def _list(value: Any, field: str, item: Callable[[Any, str], Any]) -> tuple:
    if not isinstance(value, list):
        raise SpecError(field, f"expected a list, got {type(value).__name__}")
    return tuple(item(v, f"{field}[{i}]") for i, v in enumerate(value))


def _require(obj: dict, field: str, *names: str) -> None:
    for n in names:
        if obj.get(n) is None:
            raise SpecError(f"{field}.{n}", "is required")


def _unique(items: tuple, attr: str, field: str, what: str) -> None:
    seen: set = set()
    for i, it in enumerate(items):
        key = getattr(it, attr)
        if key in seen:
            raise SpecError(f"{field}[{i}].{attr}", f"duplicate {what} {key!r}; {what}s must be unique")
        seen.add(key)


def _numa(v: Any, f: str) -> NumaNode:
    o = _obj(v, f, _NUMA)
    _require(o, f, "id")
    return NumaNode(**o)


def _disk(v: Any, f: str) -> Disk:
    o = _obj(v, f, _DISK)
    _require(o, f, "name")
    return Disk(**o)


def _accel(v: Any, f: str) -> Accelerator:
    o = _obj(v, f, _ACCEL)
    _require(o, f, "kind", "name")
    return Accelerator(**o)


def _machine(v: Any, f: str) -> Machine:
    o = _obj(
        v,
        f,
        _MACHINE,
        {
            "numa_nodes": lambda x, p: _list(x, p, _numa),
            "disks": lambda x, p: _list(x, p, _disk),
            "accelerators": lambda x, p: _list(x, p, _accel),
            "notes": lambda x, p: _list(x, p, _str),
            "isa": lambda x, p: _list(x, p, _str),
        },
    )
    _require(o, f, "name")
    m = Machine(**o)
    _unique(m.numa_nodes, "id", f"{f}.numa_nodes", "NUMA node id")
    _unique(m.disks, "name", f"{f}.disks", "disk name")
    _check_machine(m, f)
    return m


def _cpulist(ids: tuple[int, ...]) -> str:
    """(0, 1, 2, 3, 8) -> '0-3,8'."""
    runs: list[list[int]] = []
    for c in sorted(ids):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


def _check_machine(m: Machine, f: str) -> None:
    """Fields that must agree with each other: threads and cores, NUMA CPUs and the machine's CPUs."""
    n = m.hardware_threads
    if m.threads is not None and m.threads < m.cores:
        raise SpecError(
            f"{f}.threads", f"{m.threads} is fewer than cores ({m.cores}); a machine has at least one thread per core"
        )
    if m.cpus and len(m.cpus) != n:
        raise SpecError(
            f"{f}.cpus", f"names {len(m.cpus)} CPUs for {n} hardware threads; list one CPU id per hardware thread"
        )
    mine = set(m.cpu_ids)
    owner: dict[int, int] = {}
    for i, node in enumerate(m.numa_nodes):
        for cpu in node.cpus:
            if cpu not in mine:
                hint = "" if m.threads is not None or m.cpus else " (set threads when it has more threads than cores)"
                raise SpecError(
                    f"{f}.numa_nodes[{i}].cpus",
                    f"CPU {cpu} is not one of this machine's {n} hardware threads; "
                    f"valid CPU ids are {_cpulist(m.cpu_ids)}{hint}",
                )
            if cpu in owner:
                raise SpecError(
                    f"{f}.numa_nodes[{i}].cpus", f"CPU {cpu} is in numa_nodes[{owner[cpu]}] too; a CPU is in one node"
                )
            owner[cpu] = i


def _link(v: Any, f: str) -> Link:
    if isinstance(v, dict) and "endpoints" in v:
        v = dict(v)
        ep = v.pop("endpoints")
        if not (isinstance(ep, list) and len(ep) == 2 and all(isinstance(e, str) for e in ep)):
            raise SpecError(f"{f}.endpoints", f"{ep!r} is not a pair of names; use e.g. ['a', 'b']")
        v["a"], v["b"] = ep
    o = _obj(v, f, _LINK)
    _require(o, f, "a", "b", "bandwidth_bytes_per_s")
    if o["a"] == o["b"]:
        raise SpecError(f"{f}.b", f"a link cannot connect {o['a']!r} to itself")
    return Link(**o)


def from_dict(data: Any) -> Cluster:
    """Validate a parsed spec and build a Cluster; raises SpecError naming the exact field."""
    o = _obj(
        data,
        "",
        {"name": ("name", _str)},
        {
            "machines": lambda x, p: _list(x, p, _machine),
            "links": lambda x, p: _list(x, p, _link),
            "regions": lambda x, p: _list(x, p, _str),
        },
    )
    machines = o.get("machines", ())
    if not machines:
        raise SpecError("machines", "a cluster needs at least one machine")
    _unique(machines, "name", "machines", "machine name")
    regions = tuple(o.get("regions", ()))
    declared = set(regions)
    if len(declared) != len(regions):
        raise SpecError("regions", f"{list(regions)} names a region twice; region names must be unique")
    for i, m in enumerate(machines):
        if m.region is not None and regions and m.region not in declared:
            raise SpecError(f"machines[{i}].region", f"unknown region {m.region!r}; regions are {list(regions)}")
    if not regions:
        regions = tuple(dict.fromkeys(m.region for m in machines if m.region))
    names = {m.name for m in machines}
    if names & set(regions):
        raise SpecError("regions", f"names used both as machine and region: {sorted(names & set(regions))}")
    endpoints = names | set(regions)
    links = o.get("links", ())
    for i, link in enumerate(links):
        for end in ("a", "b"):
            if getattr(link, end) not in endpoints:
                raise SpecError(
                    f"links[{i}].{end}",
                    f"{getattr(link, end)!r} is not a machine or region; known: {sorted(endpoints)}",
                )
    return Cluster(name=o.get("name", "cluster"), machines=machines, links=links, regions=regions)


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:  # plain json.loads would keep the last one silently
            raise SpecError(key, "given twice in one object; keep one")
        out[key] = value
    return out


def _parse_text(text: str, fmt: str) -> Any:
    if fmt == "json":
        try:
            return json.loads(text, object_pairs_hook=_no_duplicate_keys)
        except json.JSONDecodeError as e:
            raise SpecError("", f"not valid JSON: {e}") from None
    if fmt == "toml":
        if sys.version_info >= (3, 11):
            import tomllib
        else:  # pragma: no cover - 3.10
            import tomli as tomllib
        try:
            return tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise SpecError("", f"not valid TOML: {e}") from None
    raise ValueError(f"fmt must be 'json' or 'toml', not {fmt!r}")  # pragma: no cover - loads checks it


def loads(text: str, fmt: str = "json") -> Cluster:
    """Parse and validate a spec given as JSON or TOML text; raises SpecError naming the field."""
    if fmt not in ("json", "toml"):
        raise ValueError(f"fmt must be 'json' or 'toml', not {fmt!r}")
    try:
        data = _parse_text(text, fmt)
    except RecursionError:
        raise SpecError("", f"not valid {fmt.upper()}: nested too deeply") from None
    except SpecError:
        raise
    except ValueError as e:  # e.g. an integer literal longer than Python converts
        raise SpecError("", f"not valid {fmt.upper()}: {e}") from None
    return from_dict(data)


def _read_spec_text(p: Path) -> str:
    """The file's text; a binary, non-UTF-8 or oversized file is a SpecError (the caller adds the path)."""
    try:
        with open(p, "rb") as fh:
            data = fh.read(MAX_SPEC_BYTES + 1)
    except OSError as e:
        raise SpecError("", f"cannot read it: {e.strerror}") from None
    if len(data) > MAX_SPEC_BYTES:
        raise SpecError("", f"larger than {MAX_SPEC_BYTES >> 20} MiB; a spec is a small JSON or TOML text file")
    try:
        text = data.decode("utf-8-sig")  # a byte-order mark from a Windows editor is harmless
    except UnicodeDecodeError as e:
        raise SpecError(
            "", f"not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); save the spec as UTF-8"
        ) from None
    if "\0" in text:
        raise SpecError(
            "", f"binary data (a NUL character at offset {text.index(chr(0))}); a spec is JSON or TOML text"
        )
    return text


def load(path: str | os.PathLike) -> Cluster:
    """Load a spec from a .json or .toml file (or the name of a bundled example, e.g. 'edge-home').

    Every SpecError raised carries the file in ``source`` and leads its message with it.
    """
    p = Path(path)
    if not p.exists() and p.suffix == "" and os.sep not in str(path):
        from .examples import example_path

        try:
            p = example_path(str(path))
        except FileNotFoundError as e:
            raise SpecError("", str(e)) from None
    if p.suffix not in (".json", ".toml"):
        raise SpecError("", "spec files must end in .json or .toml", source=str(p))
    try:
        return loads(_read_spec_text(p), p.suffix[1:])
    except SpecError as e:
        raise SpecError(e.field, e.message, source=str(p)) from None


def _plain(obj: Any) -> Any:
    if hasattr(obj, "__dataclass_fields__"):
        out = {}
        for f in fields(obj):
            v = getattr(obj, f.name)
            if v is None or v == () or (f.name == "notes" and not v):
                continue
            if f.name == "memory_bytes" and v == 0:  # the default, "unknown"; a spec may not say 0 bytes
                continue
            out[f.name] = _plain(v)
        return out
    if isinstance(obj, tuple):
        return [_plain(v) for v in obj]
    return obj


def to_dict(cluster: Cluster) -> dict:
    """A JSON-ready dict in SI field names; ``from_dict(to_dict(c)) == c``."""
    return _plain(cluster)


def dumps(cluster: Cluster) -> str:
    return json.dumps(to_dict(cluster), indent=2, sort_keys=False) + "\n"


def _umask() -> int:
    """This process's umask, read without changing it (os.umask would, for a moment, for every thread)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    return 0o022


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO]:
    """A file that appears at ``path`` whole or not at all: a temp file beside it, fsynced and
    renamed over ``path`` when the block ends cleanly, removed when it raises."""
    if mode not in ("w", "wb"):
        raise ValueError(f"mode must be 'w' or 'wb', not {mode!r}")
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", dir=p.parent)
    try:
        with os.fdopen(fd, mode) as fh:
            os.fchmod(fh.fileno(), 0o666 & ~_umask())  # the mode open() gives, not mkstemp's private 0600
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write text atomically: a temp file in the same directory, fsync, then os.replace."""
    with atomic_file(path, "w") as fh:
        fh.write(text)
    return Path(path)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write bytes atomically, as :func:`atomic_write_text` does text."""
    with atomic_file(path, "wb") as fh:
        fh.write(data)
    return Path(path)


def atomic_dir(target: str | os.PathLike, fill: Callable[[Path], None]) -> Path:
    """Directory ``target`` appears whole or not at all: ``fill`` writes a temporary sibling, which
    then replaces ``target`` (an old ``target`` is moved aside first and removed after)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        tmp.chmod(0o777 & ~_umask())  # the mode mkdir() would give, not mkdtemp's private 0700
        fill(tmp)
        old = None
        if target.exists():
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            os.replace(target, old)
        os.replace(tmp, target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def save(cluster: Cluster, path: str | os.PathLike) -> Path:
    """Write the spec as JSON atomically."""
    return atomic_write_text(path, dumps(cluster))
