#!/usr/bin/env python3
"""The release gate of the mlsyskit monorepo: one package per tag ``<name>-v<version>``.

    release_check.py kvpool-v0.2.0               the gate the release workflow runs for a pushed tag
    release_check.py --dry-run [--package NAME]  every package as if tagged now (CI, on every change)
    release_check.py --artifacts dist/           the wheels and sdists built into dist/
    release_check.py --ci-matrix                 the (package, python) pairs ci.yml tests, as JSON

``<name>`` is the directory name (``hwtopo`` lives in shared/hwtopo, the others in packages/); the
distribution is ``mlsyskit-<name>``. A tag's gate fails on any problem. A dry run fails only on what is
wrong in the tree itself (names, metadata, license copies, the hwtopo range); what merely keeps a
package from being released right now (entries under ``## Unreleased``, a version already on the
index, hwtopo not yet published) is reported and the run still passes.

The index is asked through pip (``pip download --no-deps`` and ``pip index versions``) with
``--isolated``, so only the index named by ``--index-url`` answers; ``--offline`` skips those checks.
Needs ``packaging`` (and ``trove-classifiers`` to check classifiers, when installed).
"""

from __future__ import annotations

import argparse
import datetime as dt
import email.message
import email.parser
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
REPO_URL = "https://github.com/mlsyskit/mlsyskit"
PREFIX = "mlsyskit-"
HWTOPO = "hwtopo"
PYPI = "https://pypi.org/simple"
URL_KEYS = ("Source", "Documentation", "Changelog")
PY_CLASSIFIER = re.compile(r"^Programming Language :: Python :: (3\.\d+)$")
RELEASE_HEADING = re.compile(r"^\[?(?P<version>[^\]\s]+)\]? - (?P<date>\d{4}-\d{2}-\d{2})$")


@dataclass
class Report:
    """What the checks found. ``strict`` (a tag's gate) turns what blocks a release into errors."""

    strict: bool
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def error(self, msg: str) -> None:
        self.errors.append(msg)
        _say("error", msg)

    def block(self, msg: str) -> None:
        """Something that keeps the package from being released now, not a fault of the tree."""
        if self.strict:
            self.error(msg)
        else:
            self.notes.append(msg)
            _say("notice", "not releasable now: " + msg)

    def note(self, msg: str) -> None:
        self.notes.append(msg)
        _say("notice", msg)


def _say(level: str, msg: str) -> None:
    if os.environ.get("GITHUB_ACTIONS") == "true":
        print(f"::{level}::{msg}", flush=True)
    else:
        print(f"{level}: {msg}", flush=True)


@dataclass
class Package:
    name: str
    path: Path
    project: dict
    poetry: dict

    @classmethod
    def load(cls, name: str) -> Package:
        path = ROOT / "shared" / HWTOPO if name == HWTOPO else ROOT / "packages" / name
        if not (path / "pyproject.toml").is_file():
            known = ", ".join(package_names())
            raise SystemExit(f"error: no package {name!r} (no {path}/pyproject.toml); known: {known}")
        data = tomllib.loads((path / "pyproject.toml").read_text())
        return cls(name, path, data.get("project", {}), data.get("tool", {}).get("poetry", {}))

    @property
    def dist(self) -> str:
        return str(self.project.get("name", ""))

    @property
    def version(self) -> str:
        return str(self.project.get("version", ""))

    @property
    def import_name(self) -> str:
        includes = [p["include"] for p in self.poetry.get("packages", []) if "include" in p]
        return includes[0] if includes else self.name.replace("-", "_")

    @property
    def python_versions(self) -> list[str]:
        found = (PY_CLASSIFIER.match(c) for c in self.project.get("classifiers", []))
        return sorted({m.group(1) for m in found if m}, key=Version)

    def requirements(self) -> list[Requirement]:
        deps = list(self.project.get("dependencies", []))
        for extra in self.project.get("optional-dependencies", {}).values():
            deps.extend(extra)
        out = []
        for d in deps:
            try:
                out.append(Requirement(d))
            except InvalidRequirement as e:
                raise SystemExit(f"error: {self.name}: dependency {d!r} is not a valid requirement: {e}") from None
        return out

    def hwtopo_requirement(self) -> Requirement | None:
        wanted = canonicalize_name(PREFIX + HWTOPO)
        return next((r for r in self.requirements() if canonicalize_name(r.name) == wanted), None)


def package_names() -> list[str]:
    return [HWTOPO, *sorted(p.parent.name for p in (ROOT / "packages").glob("*/pyproject.toml"))]


# ---------------------------------------------------------------- the tree (pyproject, files)


def check_metadata(pkg: Package, report: Report) -> None:
    """Names, license, URLs, classifiers and dependencies of one pyproject."""
    where = f"{pkg.path.relative_to(ROOT)}/pyproject.toml"
    if pkg.dist != PREFIX + pkg.name:
        report.error(f"{where}: [project] name is {pkg.dist!r}; it must be {PREFIX + pkg.name!r}")
    try:
        Version(pkg.version)
    except InvalidVersion:
        report.error(f"{where}: [project] version {pkg.version!r} is not a PEP 440 version")
    if "LICENSE" not in pkg.project.get("license-files", []):
        report.error(f'{where}: [project] license-files must list "LICENSE" (the Apache-2.0 text)')
    if pkg.project.get("license") != "Apache-2.0":
        report.error(f'{where}: [project] license must be "Apache-2.0", not {pkg.project.get("license")!r}')
    urls = pkg.project.get("urls", {})
    for key in URL_KEYS:
        if not str(urls.get(key, "")).startswith(REPO_URL):
            report.error(f"{where}: [project.urls] {key} must point into {REPO_URL}, not {urls.get(key)!r}")
    check_classifiers(pkg, where, report)
    for req in pkg.requirements():
        if req.url:
            report.error(f"{where}: {req.name} is required by URL/path ({req.url}); declare a version range")
        if canonicalize_name(req.name) == HWTOPO:
            report.error(f"{where}: requires {req.name!r}; hwtopo is distributed as {PREFIX + HWTOPO!r}")
    if pkg.name != HWTOPO:
        check_hwtopo_range(pkg, where, report)


def check_classifiers(pkg: Package, where: str, report: Report) -> None:
    classifiers = pkg.project.get("classifiers", [])
    try:
        from trove_classifiers import classifiers as known
    except ImportError:
        known = None
    for c in classifiers:
        if known is not None and c not in known:
            report.error(f"{where}: {c!r} is not a trove classifier (PyPI refuses the upload)")
        if c.startswith("License ::"):
            report.error(f"{where}: {c!r}: with a license expression (PEP 639) no License classifier is allowed")
    if "Typing :: Typed" not in classifiers:
        report.error(f"{where}: classifiers lack 'Typing :: Typed' (the package ships py.typed)")
    if not pkg.python_versions:
        report.error(f"{where}: no 'Programming Language :: Python :: 3.X' classifier: CI tests those versions")
    try:
        spec = SpecifierSet(pkg.project.get("requires-python", ""))
    except InvalidSpecifier:
        report.error(f"{where}: requires-python {pkg.project.get('requires-python')!r} is not a version specifier")
        return
    for py in pkg.python_versions:
        if not spec.contains(py + ".0"):
            report.error(f"{where}: classifier Python {py} is outside requires-python {str(spec)!r}")


def check_hwtopo_range(pkg: Package, where: str, report: Report) -> None:
    req = pkg.hwtopo_requirement()
    if req is None:
        report.error(f"{where}: no {PREFIX + HWTOPO} dependency (declare it by range, e.g. >=0.1,<0.2)")
        return
    if not any(s.operator in ("<", "<=", "~=", "==") for s in req.specifier):
        report.error(f"{where}: {req} has no upper bound; bound it below hwtopo's next minor version")
    local = Package.load(HWTOPO).version
    if not req.specifier.contains(local, prereleases=True):
        report.error(f"{where}: {req} excludes hwtopo {local} of this tree, which its tests run against")


def check_files(pkg: Package, report: Report) -> None:
    """The license copy, py.typed and the CHANGELOG the build and the release rely on."""
    rel = pkg.path.relative_to(ROOT)
    root_license = (ROOT / "LICENSE").read_bytes()
    copy = pkg.path / "LICENSE"
    if not copy.is_file():
        report.error(f"{rel}/LICENSE is missing: copy the repository's LICENSE there (license-files)")
    elif copy.read_bytes() != root_license:
        report.error(f"{rel}/LICENSE differs from the repository's LICENSE: copy it again")
    if not (pkg.path / "src" / pkg.import_name / "py.typed").is_file():
        report.error(f"{rel}/src/{pkg.import_name}/py.typed is missing (PEP 561 marker)")
    if not (pkg.path / "CHANGELOG.md").is_file():
        report.error(f"{rel}/CHANGELOG.md is missing")


# ---------------------------------------------------------------- the CHANGELOG


def changelog_sections(text: str) -> list[tuple[str, list[str]]]:
    """(heading, body lines) of every ``## `` section, in file order."""
    sections: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("## "):
            sections.append((line[3:].strip(), []))
        elif sections:
            sections[-1][1].append(line)
    return sections


def _is_unreleased(heading: str) -> bool:
    return heading.strip("[]").lower() == "unreleased"


def unreleased_entries(text: str) -> int:
    """Lines of content under ``## Unreleased`` (subheadings and blank lines are not content)."""
    return sum(
        1
        for heading, body in changelog_sections(text)
        if _is_unreleased(heading)
        for line in body
        if line.strip() and not line.startswith("#")
    )


def check_changelog(pkg: Package, version: str, report: Report) -> None:
    """The top released section is ``## <version> - <YYYY-MM-DD>`` and ``## Unreleased`` is empty."""
    path = pkg.path / "CHANGELOG.md"
    if not path.is_file():
        return  # check_files said so
    text = path.read_text()
    rel = path.relative_to(ROOT)
    entries = unreleased_entries(text)
    if entries:
        report.block(
            f"{rel}: {entries} lines under '## Unreleased' are in no release's notes: move them into a "
            f"'## <version> - <YYYY-MM-DD>' section on top (a new version if {version} is already out)"
        )
    released = [h for h, _ in changelog_sections(text) if not _is_unreleased(h)]
    if not released:
        report.block(f"{rel}: no '## {version} - <YYYY-MM-DD>' section")
        return
    m = RELEASE_HEADING.match(released[0])
    if not m:
        report.error(f"{rel}: top section '## {released[0]}' is not '## <version> - <YYYY-MM-DD>'")
        return
    try:
        dt.date.fromisoformat(m["date"])
    except ValueError:
        report.error(f"{rel}: '## {released[0]}' has no valid date (YYYY-MM-DD)")
    if not _same_version(m["version"], version):
        report.block(f"{rel}: top section is {m['version']}, not {version}: add '## {version} - <date>' on top")


def _same_version(a: str, b: str) -> bool:
    try:
        return Version(a) == Version(b)
    except InvalidVersion:
        return a == b


# ---------------------------------------------------------------- the index


class IndexUnreachable(RuntimeError):
    pass


class Index:
    """The package index, asked through pip with nothing but ``url`` configured."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._versions: dict[str, list[str]] = {}
        self._reachable: bool | None = None

    def _pip(self, *args: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "pip", "--isolated", "--disable-pip-version-check", "--retries", "2"]
        if os.environ.get("PIP_CERT"):  # --isolated drops the environment's CA bundle
            cmd += ["--cert", os.environ["PIP_CERT"]]
        return subprocess.run([*cmd, *args, "--index-url", self.url], capture_output=True, text=True, timeout=600)

    def reachable(self) -> bool:
        """pip says "no matching distribution" alike for a missing name and an unreachable index:
        a name the index surely has tells the two apart."""
        if self._reachable is None:
            self._reachable = self._pip("index", "versions", "pip").returncode == 0
        return self._reachable

    def versions(self, dist: str) -> list[str]:
        """Every version the index lists for ``dist`` (sdist-only ones too), newest first."""
        if dist not in self._versions:
            r = self._pip("index", "versions", dist)
            if r.returncode == 0:
                m = re.search(r"^Available versions: (.*)$", r.stdout, flags=re.M)
                self._versions[dist] = [v.strip() for v in m.group(1).split(",")] if m else []
            elif "No matching distribution" in r.stderr:
                self._versions[dist] = []
            else:
                raise IndexUnreachable(_last_line(r.stderr))
        return self._versions[dist]

    def download_metadata(self, requirement: str) -> email.message.Message | None:
        """Core metadata of the newest wheel matching ``requirement`` (``pip download --no-deps``);
        None when there is none. Wheels only: an sdist would run another project's build code."""
        with tempfile.TemporaryDirectory() as tmp:
            r = self._pip("download", "--no-deps", "--only-binary=:all:", "--dest", tmp, requirement)
            if r.returncode != 0:
                if "No matching distribution" in r.stderr:
                    return None
                raise IndexUnreachable(_last_line(r.stderr))
            wheels = sorted(Path(tmp).glob("*.whl"))
            return wheel_metadata(wheels[0])[0] if wheels else None


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "(pip printed nothing)"


def is_ours(meta: email.message.Message) -> bool:
    return any(u.split(",", 1)[-1].strip().startswith(REPO_URL) for u in meta.get_all("Project-URL") or [])


def check_index(pkg: Package, version: str, index: Index, report: Report, tags_here: set[str]) -> None:
    """The name is free or ours, the version is new, and the hwtopo range can be installed."""
    if not index.reachable():
        report.block(f"{index.url} did not answer: the name, version and hwtopo range were not checked")
        return
    try:
        newest = index.download_metadata(pkg.dist)
        published = index.versions(pkg.dist)
        if newest is not None and not is_ours(newest):
            who = f"{newest['Name']} {newest['Version']}: {newest.get('Summary', '')}"
            report.error(f"{pkg.dist} on {index.url} belongs to another project ({who}); choose another name")
        elif newest is None and published:
            report.error(
                f"{pkg.dist} on {index.url} has releases ({published[0]}) but no wheel: not ours; choose another name"
            )
        elif version in published:
            report.block(f"{pkg.dist} {version} is already on {index.url}: bump the version")
        else:
            owner = f"ours, newest {published[0]}" if published else "nothing published: the name is free"
            print(f"ok: {pkg.dist} on {index.url}: {owner}", flush=True)
        if pkg.name != HWTOPO:
            check_hwtopo_published(pkg, index, report, tags_here)
    except IndexUnreachable as e:
        report.block(f"{index.url} failed mid-check ({e}): the name, version and hwtopo range were not checked")


def check_hwtopo_published(pkg: Package, index: Index, report: Report, tags_here: set[str]) -> None:
    """Users get an hwtopo from the index: one in range must be there (or be released by this push),
    and the hwtopo of this tree, which the tests ran against, must be that release."""
    req = pkg.hwtopo_requirement()
    if req is None:
        return  # check_metadata said so
    hw = Package.load(HWTOPO)
    published = hw.version in index.versions(hw.dist)
    if not published and f"{HWTOPO}-v{hw.version}" not in tags_here:
        report.block(
            f"{hw.dist} {hw.version} (this tree's, in {req.specifier}; {pkg.name}'s tests ran against it) is not "
            f"on {index.url}: release it first, or tag {HWTOPO}-v{hw.version} on the same commit"
        )
    hw_entries = unreleased_entries((hw.path / "CHANGELOG.md").read_text())
    if hw_entries:
        report.block(
            f"hwtopo has {hw_entries} unreleased CHANGELOG lines: {pkg.name}'s tests ran against code no "
            f"published hwtopo has; release hwtopo and raise the range if {pkg.name} uses the new parts"
        )


# ---------------------------------------------------------------- git


def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)


def check_on_branch(ref: str, report: Report) -> None:
    """The tagged commit is on ``ref`` (e.g. origin/main): nothing unreviewed gets published."""
    r = git("merge-base", "--is-ancestor", "HEAD", ref)
    if r.returncode == 1:
        report.error(f"the tagged commit is not on {ref}: tag a commit of main")
    elif r.returncode != 0:
        report.error(f"cannot tell whether the tagged commit is on {ref} ({_last_line(r.stderr)}); fetch full history")


def tags_at_head() -> set[str]:
    r = git("tag", "--points-at", "HEAD")
    return set(r.stdout.split()) if r.returncode == 0 else set()


# ---------------------------------------------------------------- artifacts


def wheel_metadata(path: Path) -> tuple[email.message.Message, list[str]]:
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
        meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
        return email.parser.Parser().parsestr(z.read(meta).decode()), names


def sdist_metadata(path: Path) -> tuple[email.message.Message, list[str]]:
    with tarfile.open(path) as t:
        members = t.getnames()
        top = members[0].split("/")[0]
        raw = t.extractfile(f"{top}/PKG-INFO")
        if raw is None:
            raise SystemExit(f"error: {path.name} has no PKG-INFO")
        return email.parser.Parser().parsestr(raw.read().decode()), [m.split("/", 1)[-1] for m in members]


def check_core_metadata(meta: email.message.Message, pkg: Package, what: str, report: Report) -> None:
    if meta.get("Version") != pkg.version:
        report.error(f"{what}: Version {meta.get('Version')} but {pkg.name}'s pyproject says {pkg.version}")
    if meta.get("License-Expression") != pkg.project.get("license"):
        report.error(f"{what}: License-Expression is {meta.get('License-Expression')!r}")
    if "LICENSE" not in (meta.get_all("License-File") or []):
        report.error(f"{what}: no License-File: LICENSE in the metadata")
    urls = {u.split(",", 1)[0].strip() for u in meta.get_all("Project-URL") or []}
    for key in URL_KEYS:
        if key not in urls:
            report.error(f"{what}: no Project-URL {key}")
    for line in meta.get_all("Requires-Dist") or []:
        if "@" in line.split(";", 1)[0]:
            report.error(f"{what}: path/URL dependency in the metadata: {line}")


def check_artifacts(dist_dir: Path, report: Report) -> None:
    """Each wheel and sdist: metadata, the license file, py.typed; a wheel and an sdist per package."""
    pkgs = [Package.load(n) for n in package_names()]
    by_dist = {canonicalize_name(p.dist): p for p in pkgs}
    found: dict[str, set[str]] = {}
    files = sorted(dist_dir.glob("*.whl")) + sorted(dist_dir.glob("*.tar.gz"))
    if not files:
        report.error(f"{dist_dir}: no wheel or sdist (run python -m build first)")
    for f in files:
        kind = "wheel" if f.suffix == ".whl" else "sdist"
        meta, names = wheel_metadata(f) if kind == "wheel" else sdist_metadata(f)
        pkg = by_dist.get(canonicalize_name(meta.get("Name", "")))
        if pkg is None:
            report.error(f"{f.name}: distribution {meta.get('Name')!r} is no package of this repository")
            continue
        found.setdefault(pkg.name, set()).add(kind)
        check_core_metadata(meta, pkg, f.name, report)
        if kind == "wheel":
            has_license = any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
        else:
            has_license = "LICENSE" in names
        if not has_license:
            report.error(f"{f.name}: the LICENSE file is not inside")
        typed = f"{pkg.import_name}/py.typed" if kind == "wheel" else f"src/{pkg.import_name}/py.typed"
        if typed not in names:
            report.error(f"{f.name}: {typed} is not inside")
    for name, kinds in sorted(found.items()):
        if kinds != {"wheel", "sdist"}:
            report.error(f"{dist_dir}: {name} has only a {', '.join(sorted(kinds))}; build both")
    if not report.errors:
        print(f"ok: {len(files)} artifacts of {len(found)} packages in {dist_dir}")


# ---------------------------------------------------------------- entry points


def parse_tag(tag: str) -> tuple[str, str]:
    name, sep, version = tag.rpartition("-v")
    if not sep or not name or not version:
        raise SystemExit(f"error: tag {tag!r} is not <name>-v<version> (e.g. kvpool-v0.2.0)")
    return name, version


def release_gate(tag: str, args: argparse.Namespace) -> Report:
    """Everything a pushed tag must satisfy before its package is built and published."""
    report = Report(strict=True)
    name, version = parse_tag(tag)
    pkg = Package.load(name)
    if not _same_version(version, pkg.version):
        report.error(f"tag {tag} says {version} but {pkg.path.relative_to(ROOT)}/pyproject.toml says {pkg.version}")
    check_on_branch(args.main_ref, report)
    check_metadata(pkg, report)
    check_files(pkg, report)
    check_changelog(pkg, pkg.version, report)
    if not args.offline:
        check_index(pkg, pkg.version, Index(args.index_url), report, tags_at_head())
    if args.github_output and not report.errors:  # later jobs get a package only from a passed gate
        with open(args.github_output, "a") as f:
            f.write(f"package={pkg.name}\ndist={pkg.dist}\nversion={pkg.version}\n")
            f.write(f"dir={pkg.path.relative_to(ROOT).as_posix()}\n")
            f.write(f"pythons={json.dumps(pkg.python_versions)}\n")
    return report


def dry_run(names: list[str], args: argparse.Namespace) -> Report:
    """Each package as if tagged ``<name>-v<its version>`` now: tree faults fail, the rest is reported."""
    report = Report(strict=False)
    index = None if args.offline else Index(args.index_url)
    for name in names:
        pkg = Package.load(name)
        print(f"-- {pkg.name}: {pkg.dist} {pkg.version} (tag {pkg.name}-v{pkg.version})", flush=True)
        check_metadata(pkg, report)
        check_files(pkg, report)
        check_changelog(pkg, pkg.version, report)
        if index is not None:
            check_index(pkg, pkg.version, index, report, set())
    return report


def ci_matrix() -> dict:
    """Each package on each Python its classifiers claim; the integration scenarios on those all share."""
    pkgs = [Package.load(n) for n in package_names()]
    include = [{"package": p.name, "python": py} for p in pkgs for py in p.python_versions]
    shared = set.intersection(*(set(p.python_versions) for p in pkgs))
    include += [{"package": "integration", "python": py} for py in sorted(shared, key=Version)]
    return {"include": include}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tag", nargs="?", help="the pushed tag, <name>-v<version>")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="every package as if tagged now (default: all)")
    mode.add_argument("--artifacts", type=Path, metavar="DIR", help="check the wheels and sdists in DIR")
    mode.add_argument("--ci-matrix", action="store_true", help="print ci.yml's test matrix as JSON")
    ap.add_argument("--package", action="append", default=[], help="with --dry-run: only this package")
    ap.add_argument("--index-url", default=PYPI, help=f"the index to check against (default {PYPI})")
    ap.add_argument("--offline", action="store_true", help="skip the checks that ask the index")
    ap.add_argument("--main-ref", default="origin/main", help="the branch a tag must be on (default origin/main)")
    ap.add_argument(
        "--github-output", metavar="FILE", help="append package, dist, version, dir, pythons for later steps"
    )
    args = ap.parse_args(argv)
    if sum([bool(args.tag), args.dry_run, args.artifacts is not None, args.ci_matrix]) != 1:
        ap.error("give exactly one of: a tag, --dry-run, --artifacts DIR, --ci-matrix")
    if args.package and not args.dry_run:
        ap.error("--package goes with --dry-run")
    if args.ci_matrix:
        print(json.dumps(ci_matrix()))
        return 0
    if args.artifacts is not None:
        report = Report(strict=True)
        check_artifacts(args.artifacts, report)
    elif args.dry_run:
        report = dry_run(args.package or package_names(), args)
        print(f"dry run: {len(report.errors)} errors, {len(report.notes)} notes")
    else:
        report = release_gate(args.tag, args)
        if not report.errors:
            print(f"ok: {args.tag} may be released")
    return 1 if report.errors else 0


if __name__ == "__main__":
    sys.exit(main())
