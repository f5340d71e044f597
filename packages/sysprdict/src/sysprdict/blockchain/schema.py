"""The plain CSV schema of Fabric benchmark measurements, with validation naming file, row, column.

One row = one benchmark round of one scaling configuration.  Repeated runs of the same
configuration share `config_id` (derived from the configuration columns when absent), which is the
group key of the cross-validation (no configuration is ever in both a training and a test fold).

Configuration columns (vertical, horizontal, workload):
  peers, orderers, orgs                 horizontal scaling (integers >= 1)
  peer_cpus, orderer_cpus               CPU quota per node, in cores (> 0)
  peer_mem_gb, orderer_mem_gb           memory per node in GB (> 0)
  send_rate_tps                         offered load (Caliper's send rate, > 0)
  read_fraction                         share of read-only queries in the transaction mix [0, 1]
  block_size                            orderer BatchSize.MaxMessageCount (>= 1)
  batch_timeout_s                       orderer BatchTimeout (> 0)
  endorsement                           policy: OR (any org), MAJORITY, AND (all orgs)
Measured columns:
  throughput_tps, avg_latency_s, success_rate [0, 1]; optional peer_cpu_util, orderer_cpu_util
Provenance:
  source ("caliper", "csv" or "simulated"), run (repeat index)
"""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path

import hwtopo

__all__ = [
    "CONFIG_COLUMNS",
    "ENDORSEMENT",
    "MEASURED_COLUMNS",
    "SchemaError",
    "config_id",
    "read_csv",
    "validate_row",
    "write_csv",
]

ENDORSEMENT = ("OR", "MAJORITY", "AND")


class SchemaError(ValueError):
    """A bad value in a benchmark file; the message names the file, row and column."""


def _int_ge1(v: str) -> int:
    x = int(float(v))
    if x != float(v) or x < 1:
        raise ValueError("must be an integer >= 1")
    return x


def _pos(v: str) -> float:
    x = float(v)
    if not x > 0:
        raise ValueError("must be > 0")
    return x


def _nonneg(v: str) -> float:
    x = float(v)
    if not x >= 0:
        raise ValueError("must be >= 0")
    return x


def _unit(v: str) -> float:
    x = float(v)
    if not 0 <= x <= 1:
        raise ValueError("must be within [0, 1]")
    return x


def _policy(v: str) -> str:
    s = str(v).strip().upper()
    if s not in ENDORSEMENT:
        raise ValueError(f"must be one of {', '.join(ENDORSEMENT)}")
    return s


CONFIG_COLUMNS = {
    "peers": _int_ge1,
    "orderers": _int_ge1,
    "orgs": _int_ge1,
    "peer_cpus": _pos,
    "peer_mem_gb": _pos,
    "orderer_cpus": _pos,
    "orderer_mem_gb": _pos,
    "send_rate_tps": _pos,
    "read_fraction": _unit,
    "block_size": _int_ge1,
    "batch_timeout_s": _pos,
    "endorsement": _policy,
}
MEASURED_COLUMNS = {
    "throughput_tps": _nonneg,
    "avg_latency_s": _nonneg,
    "success_rate": _unit,
}
OPTIONAL_COLUMNS = {"peer_cpu_util": _nonneg, "orderer_cpu_util": _nonneg, "run": lambda v: int(float(v))}


def config_id(row: dict) -> str:
    """The group key of a configuration (all configuration columns)."""
    return "|".join(f"{k}={row[k]}" for k in CONFIG_COLUMNS)


def validate_row(raw: dict, where: str, measured: bool = True) -> dict:
    """A typed row; SchemaError naming `where` (file and row) and the column otherwise."""
    out: dict = {}
    cols = {**CONFIG_COLUMNS, **(MEASURED_COLUMNS if measured else {})}
    for col, conv in cols.items():
        if col not in raw or raw[col] is None or str(raw[col]).strip() == "":
            raise SchemaError(f"{where}, column {col!r}: missing value")
        try:
            out[col] = conv(raw[col])
        except (TypeError, ValueError) as e:
            msg = str(e) if "must" in str(e) else "is not a number"
            raise SchemaError(f"{where}, column {col!r}: {raw[col]!r} {msg}") from None
    for col, conv in OPTIONAL_COLUMNS.items():
        if raw.get(col) not in (None, ""):
            try:
                out[col] = conv(raw[col])
            except (TypeError, ValueError):
                raise SchemaError(f"{where}, column {col!r}: {raw[col]!r} is not a number") from None
    if out["orgs"] > out["peers"]:
        raise SchemaError(f"{where}, column 'orgs': {out['orgs']} organizations need at least as many peers")
    out["source"] = str(raw.get("source") or "csv")
    out["config_id"] = str(raw.get("config_id") or config_id(out))
    return out


def read_csv(path: str | os.PathLike) -> list[dict]:
    """Rows of a benchmark CSV; the header must hold every configuration and measured column."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise SchemaError(f"{path}: cannot read ({e.strerror})") from None
    reader = csv.DictReader(io.StringIO(text))
    header = reader.fieldnames or []
    missing = [c for c in (*CONFIG_COLUMNS, *MEASURED_COLUMNS) if c not in header]
    if missing:
        raise SchemaError(f"{path}, header: missing column(s) {', '.join(missing)}")
    rows = [validate_row(r, f"{path}:row {i}") for i, r in enumerate(reader, start=2)]
    if not rows:
        raise SchemaError(f"{path}: no data rows")
    return rows


def write_csv(path: str | os.PathLike, rows: list[dict]) -> Path:
    """Write rows atomically with the schema's columns first."""
    path = Path(path)
    cols = [*CONFIG_COLUMNS, *MEASURED_COLUMNS, *OPTIONAL_COLUMNS, "source", "config_id"]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore")
    w.writeheader()
    for r in rows:
        w.writerow(r)
    path.parent.mkdir(parents=True, exist_ok=True)
    hwtopo.atomic_write_text(path, buf.getvalue())
    return path
