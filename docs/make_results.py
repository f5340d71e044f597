"""Write docs/results.md from bench-output/bench.json (run by `nox -s bench`).

Every headline figure is shown next to the paper's claim and the target its issue sets, with the
machine it was measured on and any emulation the bench reported.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import sys
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent


def claims(root: Path = ROOT) -> dict[str, dict[str, tuple[str, str]]]:
    """package -> headline key -> (paper's claim, target): each package's ``[tool.mlsyskit.headline]``."""
    out = {}
    for py in sorted((root / "packages").glob("*/pyproject.toml")):
        table = tomllib.loads(py.read_text()).get("tool", {}).get("mlsyskit", {}).get("headline", {})
        out[py.parent.name] = {k: (str(v[0]), str(v[1])) for k, v in table.items()}
    return out


CLAIMS = claims()


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    if isinstance(v, dict):
        return "; ".join(f"{k}: {_fmt(x)}" for k, x in v.items())
    return str(v)


def _emulation(res: dict) -> str:
    emu = res.get("emulated")
    if not emu:
        return "none"
    if isinstance(emu, dict):
        return "; ".join(f"{k}={_fmt(v)}" for k, v in emu.items() if k != "emulated") or "yes"
    return str(emu)


def package_table(name: str, res: dict, claimed_only: bool = False) -> list[str]:
    """One package's headline table with the machine, emulation and time it was measured. A key's
    ``<key>_spread`` (median, min, max, per seed) is folded into its row as the per-seed values;
    ``claimed_only``: just the keys the package's pyproject names (a README's table)."""
    machine = res.get("machine", {})
    m = (machine.get("machines") or [{}])[0] if isinstance(machine, dict) else {}
    lines = []
    when = res.get("measured_at")
    took = res.get("bench_wall_s")
    if when:
        lines += [f"Measured {when}" + (f" (`bench --quick`, {took:.0f} s)." if took else "."), ""]
    if m:
        lines += [f"Machine: {m.get('name', '?')}, {m.get('threads', '?')} threads. Emulation: {_emulation(res)}.", ""]
    if res.get("conditions"):  # e.g. a run on a machine shared with other work: its timings are provisional
        lines += [f"Conditions: {res['conditions']}", ""]
    lines += ["| headline | measured | target | paper |", "|---|---|---|---|"]
    claims = CLAIMS.get(name, {})
    head = res.get("headline", {})
    for key, value in head.items():
        if key.endswith("_spread") and key[: -len("_spread")] in head:
            continue
        if claimed_only and claims and key not in claims:
            continue
        paper, target = claims.get(key, ("", ""))
        shown = "(nested; in the bench JSON)" if _nested(value) else _fmt(value)
        spread = head.get(f"{key}_spread")
        if isinstance(spread, dict) and "per_seed" in spread:
            shown += f" (per seed: {_fmt(spread['per_seed'])})"
        lines.append(f"| `{key}` | {shown} | {target} | {paper} |")
    return lines


def _nested(v: object) -> bool:
    """A value with dicts or lists inside a dict (a curve per seed): too large for a table cell."""
    return isinstance(v, dict) and any(
        isinstance(x, dict) and any(isinstance(y, (dict, list)) for y in x.values()) for x in v.values()
    )


LEFTOVER_KEYS = ("ranks_alive", "stopped", "watchdogs", "cgroups", "namespaces")


def safety_rows(bench: dict, sweep: dict | None = None) -> dict[str, dict]:
    """package -> the fault and attack sweep's counts: ``safety.suite`` of its bench entry (written
    by `nox -s bench`), else its entry in the sweep's own JSON ``sweep`` (hwtopo has no bench)."""
    rows = {
        n: r["safety"]["suite"]
        for n, r in bench.items()
        if isinstance(r.get("safety"), dict) and "suite" in r["safety"]
    }
    for name, r in (sweep or {}).items():
        if isinstance(r, dict) and "cli" in r:
            rows.setdefault(name, r)
    return rows


def safety_table(rows: dict[str, dict], sweep: dict | None = None) -> list[str]:
    """The "Safety" section: per package, what the sweep tried and every count that must be zero."""
    if not rows:
        return []
    when = (
        f"Measured {sweep['measured_at']} on {sweep.get('machine', '?')}. " if sweep and "measured_at" in sweep else ""
    )
    lines = [
        "## Safety",
        "",
        *([when.strip(), ""] if when else []),
        "`tests-integration/safety.py` (run by `nox -s bench`; `tests-integration/test_safety.py` asserts the",
        "zeros): malformed command lines, a crafted pickle per loader of a user's file, kill -9 of each launcher",
        "and emulator, and kvpool's same-key PUT/GET races and kill -9 loops (sizes in bench-output/safety.json).",
        "Every column after the first three must be 0 (-: the package has no such part).",
        "",
        "| package | CLI inputs | loader payloads | tracebacks | exit not 1/2 | work before checks | dirs created "
        "| code executed | left after kill -9 | wrong bytes | lost acked writes |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in sorted(rows):
        r = rows[name]
        cli, ld, lo, f = r.get("cli", {}), r.get("loaders", {}), r.get("leftovers"), r.get("faults")
        left = "-" if lo is None else str(sum(lo.get(k, 0) for k in LEFTOVER_KEYS))
        if lo is not None and lo.get("skipped"):
            left += f" ({len(lo['skipped'])} skipped)"
        code = cli.get("code_executed", 0) + ld.get("code_executed", 0)
        fault = ("-", "-") if f is None else (_fmt(f.get("wrong_bytes")), _fmt(f.get("lost_acked_writes")))
        cells = [cli.get("inputs", "-"), ld.get("payloads", "-")]
        cells += [cli.get(k, "-") for k in ("tracebacks", "bad_exit", "slow", "created")]
        lines.append(f"| {name} | " + " | ".join(map(str, [*cells, code, left, *fault])) + " |")
    return [*lines, ""]


def previous_sections(text: str) -> dict[str, str]:
    """The per-package sections (``## name version`` up to the next heading) of an earlier results page."""
    sections, name = {}, None
    for line in text.splitlines():
        if line.startswith("## "):
            name = line[3:].split()[0] if line[3:].split() else None
            if name is not None and name not in CLAIMS:
                name = None
            if name is not None:
                sections[name] = []
        if name is not None:
            sections[name].append(line)
    return {k: "\n".join(v).rstrip("\n") for k, v in sections.items()}


def render(bench: dict, when: str, previous: str = "", sweep: dict | None = None) -> str:
    """The results page. A package this run did not measure keeps its section of ``previous`` (the page as
    it was: its own "Measured" line dates it), since bench-output/ is not kept between clones. ``sweep``:
    the fault and attack sweep's JSON (bench-output/safety.json), for the packages without a bench entry."""
    kept = previous_sections(previous)
    lines = [
        "# Results",
        "",
        f"Generated by `nox -s bench` (each package's `bench --quick`); written {when}. Figures are",
        "measured in one run per package, side by side with its baselines; emulated hardware is listed",
        "per package. The papers' claims are theirs, on their hardware.",
        "",
    ]
    for name in sorted(set(bench) | (set(kept) - set(bench))):
        if name in bench:
            lines += [f"## {name} {bench[name].get('version', '')}", "", *package_table(name, bench[name]), ""]
        else:
            lines += [kept[name], ""]
    missing = [p for p in CLAIMS if p not in bench and p not in kept]
    if missing:
        lines += ["## Not measured in this run", "", ", ".join(missing), ""]
    lines += safety_table(safety_rows(bench, sweep), sweep)
    return "\n".join(lines)


BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"


def update_guides(bench: dict, guides: Path, packages: Path | None = None) -> list[Path]:
    """Refresh the bench table between the markers of each docs/packages/<name>.md page and, given
    ``packages``, of each packages/<name>/README.md."""
    done = []
    pages = [(name, guides / f"{name}.md") for name in bench]
    if packages is not None:
        pages += [(name, packages / name / "README.md") for name in bench]
    for name, page in pages:
        res = bench[name]
        if not page.exists():
            continue
        text = page.read_text()
        if BEGIN not in text or END not in text:
            continue
        head, rest = text.split(BEGIN, 1)
        tail = rest.split(END, 1)[1]
        table = "\n".join(
            [
                "",
                "_Written by `docs/make_results.py` from the bench JSON (`nox -s bench` runs both); do not edit by hand._",
                "",
                *package_table(name, res, claimed_only=page.name == "README.md"),
                "",
            ]
        )
        _atomic_write(page, head + BEGIN + "\n" + table + "\n" + END + tail)
        done.append(page)
    return done


def main(argv: list[str]) -> int:
    src = Path(argv[1]) if len(argv) > 1 else Path("bench-output/bench.json")
    dst = Path(argv[2]) if len(argv) > 2 else Path(__file__).parent / "results.md"
    bench = json.loads(src.read_text())
    sweep_path = src.with_name("safety.json")  # written beside bench.json by `nox -s bench`
    sweep = json.loads(sweep_path.read_text()) if sweep_path.exists() else None
    text = render(bench, dt.datetime.now().strftime("%Y-%m-%d %H:%M"), dst.read_text() if dst.exists() else "", sweep)
    _atomic_write(dst, text)
    print(f"wrote {dst}")
    # the guides beside the page written, and the package READMEs when it is the repo's own page
    readmes = ROOT / "packages" if dst.resolve().parent == ROOT / "docs" else None
    for page in update_guides(bench, dst.parent / "packages", readmes):
        print(f"updated {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
