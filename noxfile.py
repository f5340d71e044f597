"""All automation of the mlsyskit monorepo.

Packages are discovered from packages/*/pyproject.toml (no list to keep in sync). Every install goes
through pip with one constraints file (constraints.txt pins torch to the CPU build on disk); set
MLSYSKIT_TORCH to another requirement (e.g. a CUDA build) or to "" to drop the pin.

    nox -s tests                          hwtopo, then each package alone, then tests-integration/
    nox -s "tests(package='xronos')"      one of them
    nox -s lint | demo | bench | build | release_check
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nox

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).parent.resolve()
HWTOPO = ROOT / "shared" / "hwtopo"
PACKAGES = sorted(p.parent.name for p in (ROOT / "packages").glob("*/pyproject.toml"))
INTEGRATION = "integration"

nox.options.sessions = ["tests"]
nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = False


def _pyproject(path: Path) -> dict:
    return tomllib.loads((path / "pyproject.toml").read_text())


def _pkg_dir(name: str) -> Path:
    return HWTOPO if name == "hwtopo" else ROOT / "packages" / name


def _script(name: str) -> str:
    """The console script of a package (named like the package)."""
    scripts = _pyproject(_pkg_dir(name))["project"].get("scripts", {})
    return name if name in scripts else next(iter(scripts), name)


def _constraints(session: nox.Session) -> str:
    """Path of the constraints file, with MLSYSKIT_TORCH applied when set."""
    override = os.environ.get("MLSYSKIT_TORCH")
    src = ROOT / "constraints.txt"
    if override is None:
        return str(src)
    lines = [ln for ln in src.read_text().splitlines() if not ln.strip().startswith("torch")]
    if override.strip():
        lines.append(override.strip())
    out = Path(session.virtualenv.location) / "constraints.txt"
    out.write_text("\n".join(lines) + "\n")
    session.log(f"torch pin overridden by MLSYSKIT_TORCH: {override!r}")
    return str(out)


def _install(session: nox.Session, *reqs: str) -> None:
    session.install("--quiet", "-c", _constraints(session), *reqs)


def _with_extra(name: str, extra: str) -> str:
    """A package's path requirement, with ``extra`` when the package declares it."""
    extras = _pyproject(_pkg_dir(name))["project"].get("optional-dependencies", {})
    return f"{_pkg_dir(name)}[{extra}]" if extra in extras else str(_pkg_dir(name))


def _install_package(session: nox.Session, name: str, extras: str = "test") -> None:
    """hwtopo from its path first, then the package (with extras) from its path."""
    _install(session, str(HWTOPO) + "[test]")
    if name != "hwtopo":
        _install(session, f"{_pkg_dir(name)}[{extras}]")


def _pytest(session: nox.Session, *paths: str) -> None:
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONHASHSEED": "0"}
    session.run(
        "python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *paths, *session.posargs, env=env
    )


@nox.session
@nox.parametrize("package", ["hwtopo", *PACKAGES, INTEGRATION])
def tests(session: nox.Session, package: str) -> None:
    """hwtopo's tests; each package alone (hwtopo + itself); then the integration scenarios."""
    if package == INTEGRATION:
        _install(session, str(HWTOPO) + "[test]", *(f"{ROOT / 'packages' / p}[test]" for p in PACKAGES))
        scenarios = sorted((ROOT / "tests-integration").glob("test_*.py"))
        if not scenarios:
            session.log("tests-integration/: no scenarios yet")
            return
        _pytest(session, str(ROOT / "tests-integration"))
        return
    _install_package(session, package)
    _pytest(session, str(_pkg_dir(package) / "tests"))


# Stub packages for typed dependencies without py.typed; tomli: mypy checks as Python 3.10 (mypy.ini).
MYPY_DEPS = ("mypy>=1.10", "types-psutil", "types-tabulate", "types-tqdm", "scipy-stubs", "tomli")
MYPY_PACKAGES = list(PACKAGES)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff (check + format) over the repo, `poetry check` for every package, and mypy (mypy.ini) on
    each package's src/ alone, with the packages installed so that their imports are typed."""
    session.install("--quiet", "ruff>=0.17,<0.18", "poetry>=2.0")  # one ruff minor: format output is stable
    _install(session, *MYPY_DEPS, str(HWTOPO) + "[test]", *(f"{_pkg_dir(p)}[test]" for p in MYPY_PACKAGES))
    session.run("ruff", "check", str(ROOT))
    session.run("ruff", "format", "--check", str(ROOT))
    for name in ["hwtopo", *MYPY_PACKAGES]:
        src = _pkg_dir(name) / "src" / name.replace("-", "_")
        session.run("mypy", "--config-file", str(ROOT / "mypy.ini"), str(src))
    for name in ["hwtopo", *PACKAGES]:
        with session.chdir(_pkg_dir(name)):
            session.run("poetry", "check", "--quiet")
        deps = _pyproject(_pkg_dir(name))["project"].get("dependencies", [])
        pinned = [d for d in deps if d.replace(" ", "").startswith("torch==")]
        if pinned:
            session.error(
                f"{name}: declare torch as a range, not a pin ({pinned[0]}); the pin lives in constraints.txt"
            )


def _has_command(session: nox.Session, script: str, command: str) -> bool:
    exe = Path(session.bin) / script
    if not exe.exists():
        return False
    r = subprocess.run([str(exe), command, "--help"], capture_output=True, text=True)
    return r.returncode == 0


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@nox.session
def demo(session: nox.Session) -> None:
    """Each package's `<pkg> demo --out demo-output/<pkg>`, gathered into demo-output/index.md."""
    out = ROOT / "demo-output"
    out.mkdir(exist_ok=True)
    wanted = session.posargs or PACKAGES
    _install(session, str(HWTOPO), *(_with_extra(p, "plot") for p in wanted))
    sections, times = [], []
    for name in wanted:
        script = _script(name)
        if not _has_command(session, script, "demo"):
            session.log(f"{name}: no demo yet, skipped")
            sections.append(f"## {name}\n\nNo demo yet.\n")
            continue
        pkg_out = out / name
        started = _dt.datetime.now()
        session.run(script, "demo", "--out", str(pkg_out), external=True)
        times.append(f"| {name} | {(_dt.datetime.now() - started).total_seconds():.0f} |")
        report = pkg_out / "report.md"
        body = report.read_text() if report.exists() else "(the demo wrote no report.md)\n"
        plots = sorted(pkg_out.rglob("*.png"))
        links = "".join(f"\n![{p.stem}]({p.relative_to(out).as_posix()})\n" for p in plots)
        sections.append(f"## {name}\n\n{body}\n{links}\nFull output: [{name}/]({name}/)\n")
    stamp = _dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    timing = "| package | demo wall time, s |\n|---|---|\n" + "\n".join(times) + "\n\n" if times else ""
    index = f"# mlsyskit demo output\n\nGenerated by `nox -s demo` on {stamp}.\n\n" + timing + "\n".join(sections)
    _write(out / "index.md", index)
    session.log(f"wrote {out / 'index.md'}")


def _benches(name: str) -> list[str]:
    """The bench subcommands of a package (``[tool.mlsyskit] benches``; default ``bench``): their
    headline keys join into one entry, all run with the same --quick/--json."""
    return list(_pyproject(_pkg_dir(name)).get("tool", {}).get("mlsyskit", {}).get("benches", ["bench"]))


def _run_benches(session: nox.Session, name: str, script: str, out: Path) -> dict | None:
    """One package's bench subcommands run with --quick --json, their headlines merged."""
    merged = None
    for i, sub in enumerate(_benches(name)):
        path = out / (f"{name}.json" if i == 0 else f"{name}-{sub}.json")
        path.unlink(missing_ok=True)
        session.run(script, sub, "--quick", "--json", str(path), external=True)
        if not path.exists():
            return None
        res = json.loads(path.read_text())
        if merged is None:
            merged = res
        else:
            merged.setdefault("headline", {}).update(res.get("headline", {}))
            if res.get("emulated"):  # e.g. sysprdict's simulated blockchain data: listed under emulation
                first = merged.get("emulated")
                merged["emulated"] = {**({"bench": first} if first else {}), sub: res["emulated"]}
    return merged


SAFETY = ROOT / "tests-integration" / "safety.py"


def _merge_safety(session: nox.Session, out: Path, collected: dict, wanted: list[str]) -> None:
    """The fault and attack sweep (tests-integration/safety.py) over hwtopo and ``wanted`` into
    bench-output/safety.json; each measured package's entry gets ``safety: {"suite": <its counts
    there>, "bench": <the safety block of its own bench JSON, where it has one (kvpool)>}``. hwtopo
    has no bench entry: the results page reads its counts from safety.json."""
    path = out / "safety.json"
    path.unlink(missing_ok=True)
    # exit 1 = some bad count: it is recorded and shown; tests-integration/test_safety.py fails on it
    only = ",".join(["hwtopo", *(p for p in wanted if p != "hwtopo")])
    session.run("python", str(SAFETY), "--json", str(path), "--only", only, external=True, success_codes=[0, 1])
    if not path.exists():  # `nox --install-only`: nothing ran
        return
    suite = json.loads(path.read_text())
    for name in wanted:
        if name in collected and name in suite:
            own = collected[name].get("safety")
            collected[name]["safety"] = {"suite": suite[name], **({"bench": own} if own is not None else {})}


@nox.session
def bench(session: nox.Session) -> None:
    """Each package's `<pkg> bench --quick --json`, collected into bench-output/bench.{json,md}."""
    out = ROOT / "bench-output"
    out.mkdir(exist_ok=True)
    wanted = session.posargs or PACKAGES
    _install(session, str(HWTOPO), *(f"{ROOT / 'packages' / p}" for p in wanted))
    # A run for some packages keeps the others' last results; each entry says when it was measured.
    previous = out / "bench.json"
    collected: dict = json.loads(previous.read_text()) if session.posargs and previous.exists() else {}
    for name in wanted:
        script = _script(name)
        if not _has_command(session, script, "bench"):
            session.log(f"{name}: no bench yet, skipped")
            continue
        started = _dt.datetime.now()
        res = _run_benches(session, name, script, out)
        if res is None:  # `nox --install-only`: nothing ran
            continue
        collected[name] = res
        collected[name]["measured_at"] = started.strftime("%Y-%m-%d %H:%M")
        collected[name]["bench_wall_s"] = round((_dt.datetime.now() - started).total_seconds(), 1)
    _merge_safety(session, out, collected, wanted)
    collected = {p: collected[p] for p in PACKAGES if p in collected}
    _write(out / "bench.json", json.dumps(collected, indent=2) + "\n")
    rows = ["| package | headline key | value |", "|---|---|---|"]
    for name, res in sorted(collected.items()):
        for key, value in res.get("headline", {}).items():
            v = f"{value:.4g}" if isinstance(value, float) else str(value)
            rows.append(f"| {name} | `{key}` | {v} |")
    _write(out / "bench.md", "# bench --quick headlines\n\n" + "\n".join(rows) + "\n")
    results = ROOT / "docs" / "make_results.py"
    if results.exists():
        session.run("python", str(results), str(out / "bench.json"), external=True)


RELEASE_CHECK = ROOT / ".github" / "scripts" / "release_check.py"
RELEASE_CHECK_DEPS = ("packaging", "trove-classifiers", "tomli; python_version < '3.11'")


@nox.session
def build(session: nox.Session) -> None:
    """A wheel and an sdist for each package into dist/, then `twine check --strict` and the release
    gate's artifact checks (no path dependency, LICENSE, py.typed, Project-URLs) on all of them."""
    session.install("--quiet", "build", "twine", *RELEASE_CHECK_DEPS)
    dist = ROOT / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    for name in ["hwtopo", *(session.posargs or PACKAGES)]:
        session.run("python", "-m", "build", "--outdir", str(dist), str(_pkg_dir(name)), silent=True)
    artifacts = sorted(str(p) for p in dist.iterdir())
    session.run("twine", "check", "--strict", *artifacts)
    session.run("python", str(RELEASE_CHECK), "--artifacts", str(dist))


@nox.session
def release_check(session: nox.Session) -> None:
    """The release gate in dry-run mode for every package (what blocks a release is reported, faults
    of the tree fail), after its own tests. Arguments go to the script, e.g. `-- --offline`."""
    session.install("--quiet", "pytest", *RELEASE_CHECK_DEPS)
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", str(RELEASE_CHECK.parent))
    session.run("python", str(RELEASE_CHECK), "--dry-run", *session.posargs)


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run with nox")
