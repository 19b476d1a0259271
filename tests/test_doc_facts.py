"""Facts the docs repeat, checked against the one place each is made.

- The claim table's DDL shown in docs/ is what ``dedup-proxy schema`` prints.
- docs/configuration.md's key table has a row for every key the parser accepts, and none other;
  the keys are read from the parser itself (every section it opens), not listed here.
- docs/operations.md has a row for every metric the proxy exports, and none other.
- docs/deployment.md's alert table lists the alerts of deploy/prometheus/rules.yaml, each once,
  with its severity, and docs/runbooks.md's index lists them, each once.
- The sizing figures quoted in docs/deployment.md and deploy/kubernetes/README.md are figures
  of bench/RESULTS.md, the benchmark's own output: a figure in µs, ms, MB or per second in
  their "Sizing" sections must be printed there with the same unit. A figure worked out from
  others (a sum, a rate at a given CPU) is written with "≈" and is not looked up.
- A section the code cites (``docs/page.md, "Section"``, in a message or a comment) is a heading
  of that page (or, in docs/configuration.md, a key it documents).
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy import config, metrics
from proxy.config import reader

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
RESULTS = ROOT / "bench" / "RESULTS.md"
SIZING_PAGES = [ROOT / "docs" / "deployment.md", ROOT / "deploy" / "kubernetes" / "README.md"]


def fenced(text: str, lang: str) -> Iterator[str]:
    """The bodies of the ``lang`` fenced blocks of a Markdown text."""
    yield from re.findall(rf"^```{lang}\n(.*?)^```", text, re.MULTILINE | re.DOTALL)


def section(text: str, title: str) -> str:
    """The text under the heading ``title`` (any level), up to the next heading of that level."""
    found = re.search(rf"^(#+) {re.escape(title)}\n(.*?)(?=^\1 |\Z)", text, re.M | re.S)
    assert found, f"no section {title!r}"
    return found[2]


# The claim table's DDL.


def test_every_ddl_shown_in_the_docs_is_what_schema_prints() -> None:
    printed = subprocess.run(
        [sys.executable, "-m", "proxy", "schema"], capture_output=True, text=True, check=True
    ).stdout
    shown = {
        f"{page.relative_to(ROOT)} block {n}": block
        for page in DOCS
        for n, block in enumerate(fenced(page.read_text(), "sql"), 1)
        if "CREATE TABLE" in block
    }
    assert shown, "no CREATE TABLE in docs/: the check would pass anything"
    drifted = [where for where, block in shown.items() if block.strip() != printed.strip()]
    assert not drifted, f"differ from `dedup-proxy schema`: {drifted}\nit prints:\n{printed}"


# Configuration keys.


def parser_keys(monkeypatch: pytest.MonkeyPatch) -> dict[str, tuple[str, ...]]:
    """Each section the parser opens (``routes[].verify``) and the keys it accepts there."""
    opened: dict[str, tuple[str, ...]] = {}
    mapping = reader.Reader.mapping

    def spy(self: reader.Reader, raw: object, path: str, allowed: tuple[str, ...]) -> Any:
        opened[re.sub(r"\[\d+\]", "[]", path)] = allowed
        return mapping(self, raw, path, allowed)

    monkeypatch.setattr(reader.Reader, "mapping", spy)
    verify = {"scheme": "hmac", "header": "X-Signature", "secret": "s"}
    route = {"name": "a", "path": "/a", "event_id": "body:/id", "verify": verify, "redeliver": {},
             "receipt": {}}  # fmt: skip
    reconciled = {"name": "g", "path": "/g", "preset": "github", "verify": {"secret": "s"},
                  "reconcile": {"repository": "o/r", "hook_id": 1, "token": "t"}}  # fmt: skip
    config.parse(
        {
            "upstream": {"url": "http://127.0.0.1:3000"},
            "database": {"dsn": "postgresql://dedup@db/app"},
            "log": {},
            "admin": {},
            "sweeper": {},
            "routes": [route, reconciled],
        }
    )
    return opened


def documented_rows() -> dict[str, list[str]]:
    """The rows of docs/configuration.md's key tables: the key, and the other cells."""
    rows: dict[str, list[str]] = {}
    for line in (ROOT / "docs" / "configuration.md").read_text().splitlines():
        if found := re.match(r"\|\s*`([a-z_\[\].]+)`\s*\|(.*)\|\s*$", line):
            rows[found[1]] = [cell.strip() for cell in found[2].split("|")]
    return rows


def test_configuration_md_has_a_row_for_every_key_the_parser_accepts_and_no_other(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sections = parser_keys(monkeypatch)
    assert {"", "upstream", "database", "routes[]", "routes[].verify"} <= set(sections)
    keys = {
        f"{path}.{key}".lstrip("."): path for path, allowed in sections.items() for key in allowed
    }
    rows = documented_rows()

    def covered(key: str) -> bool:
        # A section (upstream, routes) is covered by its own row or by rows of its keys.
        return key in rows or any(row.startswith((f"{key}.", f"{key}[].")) for row in rows)

    missing = sorted(key for key in keys if not covered(key))
    unknown = sorted(row for row in rows if row not in keys)
    assert not missing, f"keys the parser accepts without a row in configuration.md: {missing}"
    assert not unknown, f"rows in configuration.md for keys the parser refuses: {unknown}"


def test_every_verify_key_has_a_row_with_its_default(monkeypatch: pytest.MonkeyPatch) -> None:
    allowed = parser_keys(monkeypatch)["routes[].verify"]
    rows = documented_rows()
    wanted = [f"routes[].verify.{key}" for key in allowed]
    without = [key for key in wanted if not (rows.get(key) or [""])[0]]
    assert not without, f"verify keys without a row (and a default) in configuration.md: {without}"


# Sizing figures.

FIGURE = re.compile(
    r"(?P<derived>≈\s*)?(?<![\w.,])(?P<low>\d[\d,]*(?:\.\d+)?)"
    r"(?:\s*[\u2013-]\s*(?P<high>\d[\d,]*(?:\.\d+)?))?\s*"
    r"(?P<unit>µs|ms\b|MB\b|(?:req|tx|webhooks|claims)?/s\b|"
    r"(?:webhooks|claims|claim transactions|requests) (?:per|a) second)"
)


def _unit(text: str) -> str:
    return "rate" if "/s" in text or "second" in text else text


def figures(text: str) -> Iterator[tuple[str, float, str]]:
    """Each quoted figure: as written, its value, its unit ("rate" for any per-second one)."""
    for found in FIGURE.finditer(text):
        if found["derived"]:
            continue
        for value in filter(None, (found["low"], found["high"])):
            yield found[0], float(value.replace(",", "")), _unit(found["unit"])


MEASURED = {(value, unit) for _, value, unit in figures(RESULTS.read_text())}


@pytest.mark.parametrize("page", SIZING_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_sizing_figures_are_bench_results(page: Path) -> None:
    sizing = section(page.read_text(), "Sizing")
    quoted = list(figures(sizing))
    stale = sorted({text for text, value, unit in quoted if (value, unit) not in MEASURED})
    assert not stale, (
        f"{page.relative_to(ROOT)}, Sizing: figures that bench/RESULTS.md does not print "
        f"(quote its figures, or mark a worked-out one with ≈): {stale}"
    )


def test_the_connection_sums_count_the_extra_pod_of_a_rollout() -> None:
    deployment_yaml = ROOT / "deploy" / "kubernetes" / "proxy" / "deployment.yaml"
    manifests = yaml.safe_load_all(deployment_yaml.read_text())
    (deployment,) = [m for m in manifests if m and m.get("kind") == "Deployment"]
    surge = deployment["spec"]["strategy"]["rollingUpdate"]["maxSurge"]
    assert surge not in (0, "0%"), "no surge pod: then the sums need no maxSurge"
    forget = [
        str(page.relative_to(ROOT))
        for page in SIZING_PAGES
        if "maxSurge" not in section(page.read_text(), "Sizing")
    ]
    assert not forget, f"connection sums without the maxSurge pod ({surge}) in: {forget}"


# The metrics.


def test_operations_md_has_a_row_for_every_metric_and_no_other() -> None:
    """A metric the proxy exports without a row is one an operator cannot know to alert on."""
    registry = metrics.Metrics().registry
    exported = set()
    for family in registry.collect():
        suffix = "_total" if family.type == "counter" else ""
        exported.add(family.name + suffix)
    text = section((ROOT / "docs" / "operations.md").read_text(), "Metrics")
    rows = set(re.findall(r"^\| `(dedup_[a-z_]+)` \|", text, re.M))
    assert sorted(exported - rows) == [], "metrics without a row in operations.md"
    assert sorted(rows - exported) == [], "rows in operations.md for metrics never exported"


# Tables of contents.


def slug(title: str) -> str:
    """GitHub's anchor for a heading (as .ci/check-links computes it)."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def tables_of_contents() -> dict[Path, tuple[list[str], list[str]]]:
    """Each page with a table of contents (``- [title](#anchor)`` lines before its first
    ``##``): the anchors it lists, and those of its ``##`` sections, in order."""
    pages = {}
    for page in [ROOT / "README.md", *DOCS, ROOT / "deploy" / "kubernetes" / "README.md"]:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
        intro, _, _ = text.partition("\n## ")
        listed = re.findall(r"^- \[[^\]]+\]\(#([^)]+)\)$", intro, re.M)
        if listed:
            sections = [slug(title) for title in re.findall(r"^## (.+)$", text, re.M)]
            pages[page] = (listed, sections)
    return pages


def test_the_docs_have_tables_of_contents() -> None:
    # The extractor finding none would pass every page.
    found = {str(page.relative_to(ROOT)) for page in tables_of_contents()}
    assert {"docs/deployment.md", "docs/operations.md", "docs/how-it-works.md"} <= found


@pytest.mark.parametrize("page", list(tables_of_contents()), ids=lambda p: str(p.relative_to(ROOT)))
def test_a_table_of_contents_lists_every_section_in_order(page: Path) -> None:
    listed, sections = tables_of_contents()[page]
    assert listed == sections, (
        f"{page.relative_to(ROOT)}: its contents list {listed}, its ## sections are {sections}"
    )


def citations() -> Iterator[tuple[str, str, str]]:
    """Each ``(docs/page.md, "Section")`` the code writes on one line: module, page, section."""
    for module in sorted((ROOT / "proxy").rglob("*.py")):
        text = module.read_text().replace("\\'", "'")
        for found in re.finditer(r'docs/([a-z-]+\.md), "([^"\n]+)"', text):
            yield str(module.relative_to(ROOT)), found[1], found[2]


def test_a_section_the_code_cites_exists() -> None:
    cited = list(citations())
    assert len(cited) > 5  # the extractor finding none would pass
    for module, page, title in cited:
        text = (ROOT / "docs" / page).read_text()
        headings = [h.replace("`", "") for h in re.findall(r"^#{1,4} (.+)$", text, re.MULTILINE)]
        # "Reconcile" cites "## Reconcile: recovering what the provider failed to deliver".
        named = any(re.match(rf"{re.escape(title)}($|[: ])", h) for h in headings)
        key = re.search(rf"`([\w\[\].]+\.)?{re.escape(title)}`", text)
        assert named or (page == "configuration.md" and key), (
            f"{module} cites docs/{page}, {title!r}: no such section"
        )


def rules_alerts() -> list[tuple[str, str]]:
    """deploy/prometheus/rules.yaml's alerts, in order, with their severities."""
    rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "rules.yaml").read_text())
    return [(rule["alert"], rule["labels"]["severity"])
            for group in rules["groups"] for rule in group["rules"]]  # fmt: skip


def test_deployments_alert_table_is_the_rules_alerts_with_their_severities() -> None:
    text = section((ROOT / "docs" / "deployment.md").read_text(), "What to alert on")
    rows = re.findall(r"^\| `(Dedup\w+)` \|.*\| (\w+) \|$", text, re.MULTILINE)
    assert len(rows) == len(dict(rows)), "an alert listed twice"
    assert dict(rows) == dict(rules_alerts())


def test_the_runbooks_index_is_the_rules_alerts() -> None:
    text = (ROOT / "docs" / "runbooks.md").read_text()
    index = re.findall(r"^- \[(Dedup\w+)\]\(#(\w+)\)$", text, re.MULTILINE)
    assert sorted(name for name, _ in index) == sorted(name for name, _ in rules_alerts())
    assert all(anchor == name.lower() for name, anchor in index)
