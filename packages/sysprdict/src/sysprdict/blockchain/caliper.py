"""Loader for Hyperledger Caliper reports (HTML and JSON), the real data path.

Caliper's `report.html` holds a "Summary of performance metrics" table (Name, Succ, Fail, Send Rate
(TPS), Max/Min/Avg Latency (s), Throughput (TPS)) and resource-utilization tables per monitored
container (Name, CPU%(max), CPU%(avg), Memory(max) [MB], ...).  Reports do not describe the network's
scaling configuration, so each report comes with one: a `config` object inside a JSON report, or a
sidecar file `<report>.config.json` next to an HTML report, holding the schema's configuration
columns (peers, orderers, orgs, peer_cpus, ...; `send_rate_tps` defaults to each round's measured
send rate).  A JSON report mirrors the HTML tables:

    {"config": {...}, "rounds": [{"Name": ..., "Succ": ..., "Fail": ..., "Send Rate (TPS)": ...,
     "Avg Latency (s)": ..., "Throughput (TPS)": ...}], "resources": [{"Name": ..., "CPU%(avg)": ...}]}

Every round becomes one schema row with source "caliper".
"""

from __future__ import annotations

import json
import os
from html.parser import HTMLParser
from pathlib import Path

from .schema import SchemaError, validate_row

__all__ = ["CaliperError", "load_caliper", "parse_caliper_html", "parse_caliper_json"]

SUMMARY_COLUMNS = ("Name", "Succ", "Fail", "Send Rate (TPS)", "Avg Latency (s)", "Throughput (TPS)")


class CaliperError(SchemaError):
    """A malformed Caliper report; the message names the file and what is wrong."""


class _Tables(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tables: list[list[list[str]]] = []
        self._row: list[str] | None = None
        self._cell: list[str] | None = None
        self._depth = 0

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self.tables.append([])
            self._depth += 1
        elif tag == "tr" and self._depth:
            self._row = []
        elif tag in ("td", "th") and self._row is not None:
            self._cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None and self._row is not None:
            self._row.append(" ".join("".join(self._cell).split()))
            self._cell = None
        elif tag == "tr" and self._row is not None:
            if self._row:
                self.tables[-1].append(self._row)
            self._row = None
        elif tag == "table":
            self._depth = max(0, self._depth - 1)

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def _num(v, path: Path, what: str) -> float:
    try:
        return float(str(v).replace(",", "").strip())
    except ValueError:
        raise CaliperError(f"{path}: {what}: {v!r} is not a number") from None


def _rounds_and_resources(tables: list[list[list[str]]], path: Path) -> tuple[list[dict], list[dict]]:
    rounds, resources = [], []
    for t in tables:
        if not t:
            continue
        head = t[0]
        if all(c in head for c in ("Name", "Succ", "Fail", "Throughput (TPS)")):
            rounds += [dict(zip(head, r)) for r in t[1:] if len(r) == len(head)]
        elif "Name" in head and any(h.startswith("CPU%") for h in head):
            resources += [dict(zip(head, r)) for r in t[1:] if len(r) == len(head)]
    return rounds, resources


def _rows(report: dict, path: Path) -> list[dict]:
    cfg = report.get("config")
    if not isinstance(cfg, dict):
        raise CaliperError(
            f"{path}: no scaling configuration; add a 'config' object (JSON) or a sidecar {path.name}.config.json"
        )
    rounds = report.get("rounds")
    if not isinstance(rounds, list) or not rounds:
        raise CaliperError(f"{path}: no 'Summary of performance metrics' rounds found")
    res = report.get("resources") or []
    peer_cpu = [_num(r.get("CPU%(avg)", 0), path, "CPU%(avg)") / 100 for r in res if "peer" in str(r.get("Name", ""))]
    ord_cpu = [_num(r.get("CPU%(avg)", 0), path, "CPU%(avg)") / 100 for r in res if "orderer" in str(r.get("Name", ""))]
    out = []
    for i, rd in enumerate(rounds):
        if not isinstance(rd, dict):
            raise CaliperError(f"{path}: round {i} is not an object")
        missing = [c for c in SUMMARY_COLUMNS if c not in rd]
        if missing:
            raise CaliperError(f"{path}: round {i} lacks column(s) {', '.join(missing)}")
        succ = _num(rd["Succ"], path, f"round {i} Succ")
        fail = _num(rd["Fail"], path, f"round {i} Fail")
        if succ + fail <= 0:
            raise CaliperError(f"{path}: round {i} ({rd['Name']}) has no transactions")
        raw = {
            **cfg,
            "send_rate_tps": cfg.get("send_rate_tps") or _num(rd["Send Rate (TPS)"], path, f"round {i} Send Rate"),
            "throughput_tps": _num(rd["Throughput (TPS)"], path, f"round {i} Throughput"),
            "avg_latency_s": _num(rd["Avg Latency (s)"], path, f"round {i} Avg Latency"),
            "success_rate": succ / (succ + fail),
            "source": "caliper",
            "run": cfg.get("run", 0),
        }
        if isinstance(cfg.get("rounds"), dict) and rd["Name"] in cfg["rounds"]:
            raw.update(cfg["rounds"][rd["Name"]])
        if peer_cpu:
            raw["peer_cpu_util"] = sum(peer_cpu) / len(peer_cpu)
        if ord_cpu:
            raw["orderer_cpu_util"] = sum(ord_cpu) / len(ord_cpu)
        out.append(validate_row(raw, f"{path}: round {i} ({rd['Name']})"))
    return out


def parse_caliper_html(path: str | os.PathLike, config: dict | None = None) -> list[dict]:
    """Rows of a Caliper HTML report (config from `config` or `<path>.config.json`)."""
    path = Path(path)
    text = path.read_text(errors="replace")
    p = _Tables()
    try:
        p.feed(text)
    except Exception as e:  # noqa: BLE001 - html.parser errors are rare; name the file
        raise CaliperError(f"{path}: not parseable HTML ({e})") from None
    rounds, resources = _rounds_and_resources(p.tables, path)
    if not rounds:
        raise CaliperError(f"{path}: no 'Summary of performance metrics' table (Name/Succ/Fail/Throughput) found")
    if config is None:
        side = path.with_name(path.name + ".config.json")
        if side.exists():
            config = _read_json(side)
    return _rows({"config": config, "rounds": rounds, "resources": resources}, path)


def _read_json(path: Path) -> dict:
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise CaliperError(f"{path}: not UTF-8 text; expected a Caliper JSON report") from None
    except json.JSONDecodeError as e:
        raise CaliperError(f"{path}: not valid JSON (line {e.lineno}: {e.msg})") from None
    if not isinstance(obj, dict):
        raise CaliperError(f"{path}: expected a JSON object")
    return obj


def parse_caliper_json(path: str | os.PathLike) -> list[dict]:
    """Rows of a JSON report in the format of the module docstring."""
    path = Path(path)
    return _rows(_read_json(path), path)


def load_caliper(path: str | os.PathLike) -> list[dict]:
    """Rows of one report (.html/.json) or of every report in a directory."""
    path = Path(path)
    if path.is_dir():
        files = sorted(
            f
            for f in path.iterdir()
            if f.suffix in (".html", ".htm") or (f.suffix == ".json" and not f.name.endswith(".config.json"))
        )
        if not files:
            raise CaliperError(f"{path}: no Caliper reports (*.html, *.json) in this directory")
        return [r for f in files for r in load_caliper(f)]
    if not path.exists():
        raise CaliperError(f"{path}: no such file")
    if path.suffix in (".html", ".htm"):
        return parse_caliper_html(path)
    if path.suffix == ".json":
        return parse_caliper_json(path)
    raise CaliperError(f"{path}: unknown report type; use a Caliper .html or .json report")
