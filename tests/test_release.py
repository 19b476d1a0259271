"""A release names one version everywhere a user or an operator reads it.

``proxy.__version__`` is the one place it is set (pyproject.toml reads it); these tests check
that ``dedup-proxy --version``, the ``dedup_build_info`` gauge, the CHANGELOG's newest release,
the image's label and the manifests' image tag all say the same (docs/development.md,
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
IMAGE = "registry.example.com/dedup-proxy"


def exposition(registry: CollectorRegistry) -> dict[str, list[dict[str, str]]]:
    """The labels of each sample of ``/metrics``' text, by sample name."""
    text = generate_latest(registry).decode()
    found: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append(dict(sample.labels, value=str(sample.value)))
    return found


def test_the_version_is_semantic() -> None:
    assert SEMVER.fullmatch(proxy.__version__), proxy.__version__


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


def test_the_changelogs_newest_release_is_the_version() -> None:
    """The first ``## X.Y.Z — date`` heading (an empty ``## Unreleased`` may stand above it)."""
    changelog = (ROOT / "CHANGELOG.md").read_text()
    releases = re.findall(r"^## (\S+) — (\d{4}-\d{2}-\d{2})$", changelog, re.MULTILINE)
    assert releases, "no '## X.Y.Z — YYYY-MM-DD' heading in CHANGELOG.md"
    assert releases[0][0] == proxy.__version__
    assert all(SEMVER.fullmatch(version) for version, _ in releases), releases
    dates = [date for _, date in releases]
    assert dates == sorted(dates, reverse=True), "releases not newest first"


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


def test_every_alerts_runbook_url_is_its_section_of_the_releases_runbooks() -> None:
    """An alert's link opens the runbook of the rules that fired it: docs/runbooks.md at the
    release's tag, the section named after the alert."""
    rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "rules.yaml").read_text())
    page = (ROOT / "docs" / "runbooks.md").read_text()
    sections = set(re.findall(r"^## (Dedup\w+)$", page, re.MULTILINE))
    base = f"https://git.example.com/dedup-proxy/blob/v{proxy.__version__}/docs/runbooks.md#"
    alerts = [rule for group in rules["groups"] for rule in group["rules"]]
    assert alerts
    for rule in alerts:
        annotations = rule["annotations"]
        assert "runbook" not in annotations, rule["alert"]
        assert annotations["runbook_url"] == base + rule["alert"].lower()
        assert rule["alert"] in sections
    assert sections == {rule["alert"] for rule in alerts}, "runbooks of no alert"
