"""A tree names one version everywhere a user or an operator reads it.

``proxy.__version__`` is the one place it is set (pyproject.toml reads it): a release's
``X.Y.Z``, or between releases the next one's development version, ``X.Y.Z.devN``, so that a
build from a tree between releases is never taken for the release before it. These tests check
that ``dedup-proxy --version``, the ``dedup_build_info`` gauge, the image's label and the
manifests' image tag all say it; that a release is the CHANGELOG's newest, and a development
version comes after it with an ``Unreleased`` section; and that the alert rules' runbook links
name a tree that exists: the release's tag, or ``main`` between releases (docs/development.md,
"Releases").
"""

from __future__ import annotations

import platform
import re
import subprocess
import sys
from pathlib import Path

import yaml
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

import proxy
from proxy import metrics

ROOT = Path(__file__).resolve().parents[1]
KUBERNETES = ROOT / "deploy" / "kubernetes"
SEMVER = re.compile(r"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)")
# PEP 440's development release of the next version: what a tree between releases says.
DEVELOPMENT = re.compile(rf"({SEMVER.pattern})\.dev(0|[1-9]\d*)")
IMAGE = "registry.example.com/dedup-proxy"


def exposition(registry: CollectorRegistry) -> dict[str, list[dict[str, str]]]:
    """The labels of each sample of ``/metrics``' text, by sample name."""
    text = generate_latest(registry).decode()
    found: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append(dict(sample.labels, value=str(sample.value)))
    return found


def release_of(version: str) -> tuple[int, ...]:
    """``X.Y.Z`` of a release or of a development version, as numbers to compare."""
    return tuple(int(part) for part in version.split(".")[:3])


def is_development(version: str) -> bool:
    return DEVELOPMENT.fullmatch(version) is not None


def test_the_version_is_a_release_or_the_next_ones_development_version() -> None:
    assert SEMVER.fullmatch(proxy.__version__) or is_development(proxy.__version__), (
        proxy.__version__
    )


def test_development_versions_are_told_from_releases() -> None:
    assert is_development("0.3.0.dev0")
    assert is_development("1.0.0.dev12")
    for version in ("0.2.0", "0.3.0dev0", "0.3.0.dev", "0.3.0.dev01", "0.3.0-dev0", "0.3.dev0"):
        assert not is_development(version), version


def test_version_flag_prints_the_version() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "proxy", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"dedup-proxy {proxy.__version__}\n"


def test_build_info_gauge_names_the_version_and_the_python() -> None:
    samples = exposition(metrics.Metrics().registry)
    assert samples["dedup_build_info"] == [
        {"version": proxy.__version__, "python": platform.python_version(), "value": "1.0"}
    ]


def test_the_changelogs_newest_release_is_the_version_or_the_one_before_it() -> None:
    """A release is the first ``## X.Y.Z — date`` heading (an empty ``## Unreleased`` may stand
    above it); a development version comes after that release, and the CHANGELOG's first
    section is ``## Unreleased``, where its changes land."""
    changelog = (ROOT / "CHANGELOG.md").read_text()
    releases = re.findall(r"^## (\S+) — (\d{4}-\d{2}-\d{2})$", changelog, re.MULTILINE)
    assert releases, "no '## X.Y.Z — YYYY-MM-DD' heading in CHANGELOG.md"
    if is_development(proxy.__version__):
        assert release_of(proxy.__version__) > release_of(releases[0][0]), releases[0]
        sections = re.findall(r"^## (.+)$", changelog, re.MULTILINE)
        assert sections[0] == "Unreleased", sections[:2]
    else:
        assert releases[0][0] == proxy.__version__
    assert all(SEMVER.fullmatch(version) for version, _ in releases), releases
    dates = [date for _, date in releases]
    assert dates == sorted(dates, reverse=True), "releases not newest first"


def test_a_tree_with_unreleased_changes_says_a_development_version() -> None:
    """Changes under ``## Unreleased`` are not in the release before them: a tree holding any
    says the next release's development version, never that release's number."""
    changelog = (ROOT / "CHANGELOG.md").read_text()
    unreleased = re.search(r"^## Unreleased$(.*?)^## ", changelog, re.MULTILINE | re.DOTALL)
    if unreleased is not None and unreleased.group(1).strip():
        assert is_development(proxy.__version__), proxy.__version__


def test_the_image_is_labelled_with_the_version() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    labels = re.findall(r'org\.opencontainers\.image\.version="([^"]*)"', dockerfile)
    assert labels == [proxy.__version__]


def test_the_manifests_run_the_versions_image() -> None:
    tags = []
    for path in sorted(KUBERNETES.glob("**/*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if not isinstance(document, dict):
                continue
            if document.get("kind") == "Kustomization":
                tags += [
                    image["newTag"]
                    for image in document.get("images", [])
                    if image["name"] == IMAGE
                ]
                continue
            pod = (document.get("spec") or {}).get("template", {}).get("spec", {})
            for container in pod.get("containers", []) + pod.get("initContainers", []):
                name, _, tag = container["image"].rpartition(":")
                if name == IMAGE:
                    tags.append(tag)
    # The Deployment, the migrate Job's init container and container, and the newTag of the
    # proxy's and the migrate Job's kustomizations.
    assert len(tags) == 5, tags
    assert set(tags) == {proxy.__version__}


def test_every_alerts_runbook_url_is_its_section_of_the_trees_runbooks() -> None:
    """An alert's link opens the runbook of the rules that fired it: docs/runbooks.md at the
    release's tag (pushed with the release), or at ``main`` between releases (no tag names a
    development version), the section named after the alert."""
    rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "rules.yaml").read_text())
    page = (ROOT / "docs" / "runbooks.md").read_text()
    sections = set(re.findall(r"^## (Dedup\w+)$", page, re.MULTILINE))
    tree = "main" if is_development(proxy.__version__) else f"v{proxy.__version__}"
    base = f"https://git.example.com/dedup-proxy/blob/{tree}/docs/runbooks.md#"
    alerts = [rule for group in rules["groups"] for rule in group["rules"]]
    assert alerts
    for rule in alerts:
        annotations = rule["annotations"]
        assert "runbook" not in annotations, rule["alert"]
        assert annotations["runbook_url"] == base + rule["alert"].lower()
        assert rule["alert"] in sections
    assert sections == {rule["alert"] for rule in alerts}, "runbooks of no alert"
