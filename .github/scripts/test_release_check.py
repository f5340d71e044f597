"""Tests of the release gate: CHANGELOG rules, metadata rules, built artifacts and the index checks.

The index tests serve a PEP 503 directory index from tmp_path (file://) to the real pip, so they
need no network.
"""

from __future__ import annotations

import argparse
import copy
import io
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import release_check as rc  # noqa: E402

KV = rc.Package.load("kvpool")


def _pkg(**project_changes) -> rc.Package:
    project = copy.deepcopy(KV.project) | project_changes
    return rc.Package(KV.name, KV.path, project, KV.poetry)


def _changelog(tmp_path: Path, text: str) -> rc.Package:
    """kvpool's pyproject with a CHANGELOG of ``text`` in tmp_path (the caller moves ROOT above it,
    since messages name paths relative to ROOT)."""
    pkg = rc.Package(KV.name, tmp_path, KV.project, KV.poetry)
    (tmp_path / "CHANGELOG.md").write_text(text)
    return pkg


def test_parse_tag_keeps_dashes_in_the_name():
    assert rc.parse_tag("parser-moe-v0.2.0") == ("parser-moe", "0.2.0")
    with pytest.raises(SystemExit, match="not <name>-v<version>"):
        rc.parse_tag("kvpool-0.2.0")


def test_empty_unreleased_subsections_are_not_content():
    text = "# Changelog\n\n## Unreleased\n### Added\n\n### Fixed\n\n## 0.2.0 - 2026-12-01\n- a\n"
    assert rc.unreleased_entries(text) == 0
    assert rc.unreleased_entries(text.replace("### Fixed\n", "### Fixed\n- a fix\n")) == 1


def _check(pkg: rc.Package, version: str, strict: bool) -> rc.Report:
    report = rc.Report(strict=strict)
    rc.check_changelog(pkg, version, report)
    return report


def test_changelog_gate_fails_a_tag_and_only_reports_in_a_dry_run(tmp_path, monkeypatch):
    monkeypatch.setattr(rc, "ROOT", tmp_path.parent)
    pkg = _changelog(tmp_path, "## Unreleased\n### Added\n- new thing\n\n## 0.1.0 - 2026-11-30\n- first\n")
    tag = _check(pkg, "0.1.0", strict=True)
    assert len(tag.errors) == 1 and "1 lines under '## Unreleased'" in tag.errors[0]
    dry = _check(pkg, "0.1.0", strict=False)
    assert dry.errors == [] and len(dry.notes) == 1


def test_changelog_top_section_must_be_the_version(tmp_path, monkeypatch):
    monkeypatch.setattr(rc, "ROOT", tmp_path.parent)
    pkg = _changelog(tmp_path, "## Unreleased\n\n## 0.1.0 - 2026-11-30\n- first\n")
    assert _check(pkg, "0.1.0", strict=True).errors == []
    wrong = _check(pkg, "0.2.0", strict=True).errors
    assert len(wrong) == 1 and "top section is 0.1.0, not 0.2.0" in wrong[0]
    (tmp_path / "CHANGELOG.md").write_text("## 0.2.0 - 2026-13-01\n- x\n")
    assert any("no valid date" in e for e in _check(pkg, "0.2.0", strict=False).errors)
    (tmp_path / "CHANGELOG.md").write_text("## 0.2.0\n- x\n")
    assert any("is not '## <version> - <YYYY-MM-DD>'" in e for e in _check(pkg, "0.2.0", strict=False).errors)


def _metadata_errors(pkg: rc.Package) -> list[str]:
    report = rc.Report(strict=False)
    rc.check_metadata(pkg, report)
    return report.errors


def test_the_tree_passes_its_own_metadata_checks():
    for name in rc.package_names():
        pkg = rc.Package.load(name)
        report = rc.Report(strict=False)
        rc.check_metadata(pkg, report)
        rc.check_files(pkg, report)
        assert report.errors == [], name


def test_metadata_faults_each_give_one_error():
    deps = [d for d in KV.project["dependencies"] if "hwtopo" not in d]
    cases = {
        "must be 'mlsyskit-kvpool'": _pkg(name="kvpool"),
        "hwtopo is distributed as": _pkg(dependencies=[*deps, "hwtopo>=0.1,<0.2", "mlsyskit-hwtopo>=0.1,<0.2"]),
        "no upper bound": _pkg(dependencies=[*deps, "mlsyskit-hwtopo>=0.1"]),
        "excludes hwtopo": _pkg(dependencies=[*deps, "mlsyskit-hwtopo>=9.0,<10"]),
        "no mlsyskit-hwtopo dependency": _pkg(dependencies=deps),
        "by URL/path": _pkg(dependencies=[*deps, "mlsyskit-hwtopo @ file:///src/hwtopo"]),
        "license-files must list": _pkg(**{"license-files": []}),
        "Source must point into": _pkg(urls={k: v for k, v in KV.project["urls"].items() if k != "Source"}),
        "outside requires-python": _pkg(**{"requires-python": ">=3.11"}),
        "no 'Programming Language": _pkg(classifiers=["Typing :: Typed"]),
    }
    for expected, pkg in cases.items():
        errors = _metadata_errors(pkg)
        assert any(expected in e for e in errors), (expected, errors)


def _wheel(path: Path, meta: str, files: dict[str, str]) -> Path:
    name, version = path.name.split("-")[:2]
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        for f, body in files.items():
            z.writestr(f, body)
        z.writestr(f"{info}/METADATA", meta)
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


def _sdist(path: Path, meta: str, files: dict[str, str]) -> Path:
    top = path.name.removesuffix(".tar.gz")
    with tarfile.open(path, "w:gz") as t:
        for f, body in {"PKG-INFO": meta, **files}.items():
            data = body.encode()
            info = tarfile.TarInfo(f"{top}/{f}")
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return path


def _core_metadata(pkg: rc.Package, extra: str = "") -> str:
    urls = "".join(f"Project-URL: {k}, {v}\n" for k, v in pkg.project["urls"].items())
    return (
        f"Metadata-Version: 2.4\nName: {pkg.dist}\nVersion: {pkg.version}\nSummary: test\n"
        f"License-Expression: Apache-2.0\nLicense-File: LICENSE\n{urls}"
        f"Requires-Dist: mlsyskit-hwtopo (>=0.1,<0.2)\n{extra}"
    )


def test_artifacts_pass_when_complete_and_name_what_is_missing(tmp_path):
    meta = _core_metadata(KV)
    stem = f"mlsyskit_kvpool-{KV.version}"
    _wheel(
        tmp_path / f"{stem}-py3-none-any.whl", meta, {"kvpool/py.typed": "", f"{stem}.dist-info/licenses/LICENSE": "x"}
    )
    _sdist(tmp_path / f"{stem}.tar.gz", meta, {"LICENSE": "x", "src/kvpool/py.typed": ""})
    ok = rc.Report(strict=True)
    rc.check_artifacts(tmp_path, ok)
    assert ok.errors == []

    bad = tmp_path / "bad"
    bad.mkdir()
    _wheel(bad / f"{stem}-py3-none-any.whl", _core_metadata(KV, "Requires-Dist: x @ file:///x\n"), {})
    report = rc.Report(strict=True)
    rc.check_artifacts(bad, report)
    joined = "\n".join(report.errors)
    for expected in (
        "path/URL dependency",
        "LICENSE file is not inside",
        "kvpool/py.typed is not inside",
        "only a wheel",
    ):
        assert expected in joined


def _index(root: Path, wheels: dict[str, str]) -> str:
    """A PEP 503 index under root/simple serving the given wheels (file name -> METADATA)."""
    files = root / "files"
    files.mkdir(parents=True)
    projects: dict[str, list[str]] = {}
    for fname, meta in wheels.items():
        _wheel(files / fname, meta, {})
        projects.setdefault(rc.canonicalize_name(fname.split("-")[0]), []).append(fname)
    for project, names in projects.items():
        page = root / "simple" / project / "index.html"
        page.parent.mkdir(parents=True)
        links = "".join(f'<a href="../../files/{n}">{n}</a>\n' for n in names)
        page.write_text(f"<!DOCTYPE html><html><body>\n{links}</body></html>\n")
    return (root / "simple").as_uri()


def _pip_meta(name: str, version: str, source: str) -> str:
    return f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\nProject-URL: Source, {source}\n"


def test_index_tells_free_ours_and_taken_names_apart(tmp_path):
    hw = rc.Package.load("hwtopo")
    url = _index(
        tmp_path,
        {
            "pip-99.0-py3-none-any.whl": _pip_meta("pip", "99.0", "https://example.invalid/pip"),
            "mlsyskit_kvpool-0.0.1-py3-none-any.whl": _pip_meta(
                "mlsyskit-kvpool", "0.0.1", "https://example.invalid/x"
            ),
            f"mlsyskit_hwtopo-{hw.version}-py3-none-any.whl": _pip_meta("mlsyskit-hwtopo", hw.version, rc.REPO_URL),
            "mlsyskit_cona-0.0.1-py3-none-any.whl": _pip_meta("mlsyskit-cona", "0.0.1", rc.REPO_URL),
        },
    )
    index = rc.Index(url)

    taken = rc.Report(strict=False)
    rc.check_index(KV, "0.1.0", index, taken, set())
    assert any("belongs to another project" in e for e in taken.errors)

    cona = rc.Package.load("cona")
    ours = rc.Report(strict=True)
    rc.check_index(cona, "0.0.1", index, ours, set())
    assert any("0.0.1 is already on" in e for e in ours.errors)
    assert not any("belongs to another project" in e for e in ours.errors)

    free = rc.Report(strict=True)
    rc.check_index(rc.Package.load("geomesh"), "0.1.0", index, free, set())
    assert not any("another project" in e or "already on" in e or "is not on" in e for e in free.errors)


def test_hwtopo_unpublished_blocks_unless_tagged_on_the_same_commit(tmp_path):
    url = _index(tmp_path, {"pip-99.0-py3-none-any.whl": _pip_meta("pip", "99.0", "https://example.invalid/pip")})
    index = rc.Index(url)
    hw = rc.Package.load("hwtopo")
    alone = rc.Report(strict=True)
    rc.check_hwtopo_published(KV, index, alone, set())
    assert any(f"{hw.dist} {hw.version}" in e and "is not on" in e for e in alone.errors)
    together = rc.Report(strict=True)
    rc.check_hwtopo_published(KV, index, together, {f"hwtopo-v{hw.version}"})
    assert not any("is not on" in e for e in together.errors)


def test_unreachable_index_is_reported_not_guessed(tmp_path):
    index = rc.Index((tmp_path / "nothing").as_uri())
    report = rc.Report(strict=False)
    rc.check_index(KV, KV.version, index, report, set())
    assert report.errors == [] and any("did not answer" in n for n in report.notes)


def test_tag_gate_rejects_a_version_other_than_pyproject():
    args = argparse.Namespace(offline=True, main_ref="HEAD", github_output=None, index_url=rc.PYPI)
    report = rc.release_gate("kvpool-v99.0.0", args)
    assert any("tag kvpool-v99.0.0 says 99.0.0" in e for e in report.errors)
