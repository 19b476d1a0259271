#!/usr/bin/env python3
"""The Grafana dashboard of dedup-proxy: its panels as a list (``ROWS``), written as JSON.

    deploy/grafana/dashboard.py [--write]

Without --write, prints the dashboard's JSON; with it, writes deploy/grafana/dedup-proxy.json
(import it in Grafana: docs/operations.md, "Dashboard") and
deploy/kubernetes/monitoring/grafana-dashboard.yaml (the same JSON in a ConfigMap for Grafana's
dashboard sidecar). deploy/check-manifests fails when either file differs from what this script
writes, and tests/test_dashboard.py runs every panel's queries against a real Prometheus that
scrapes a real proxy: a panel added here is tested there without more.

To add a panel: a ``Panel`` in its row of ``ROWS`` (a query takes the template variables through
``ROUTE`` or ``INSTANCE`` and ``$__rate_interval`` as its rate window), then --write. Panels are
laid out three to a line, in order. Plain Python and the standard library, no Grafana SDK
(docs/operations.md says why); the JSON is Grafana's dashboard model, schema version 41 (Grafana
11.6 and 12).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
JSON_FILE = HERE / "dedup-proxy.json"
CONFIG_MAP_FILE = HERE.parent / "kubernetes" / "monitoring" / "grafana-dashboard.yaml"
UID = "dedup-proxy"
SCHEMA_VERSION = 41
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
WIDTH, HEIGHT, PER_LINE = 8, 8, 3  # of Grafana's 24-column grid

# Label matchers every query carries: the template variables (regexes: "All" is .*).
INSTANCE = 'instance=~"$instance"'
ROUTE = f'route=~"$route", {INSTANCE}'


@dataclass(frozen=True, slots=True, kw_only=True)
class Target:
    """One PromQL query of a panel and its legend (Grafana's ``{{label}}`` syntax)."""

    expr: str
    legend: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Panel:
    """A time series panel: its queries share the unit (Grafana's unit IDs: reqps, s, bytes)."""

    title: str
    description: str
    unit: str
    targets: tuple[Target, ...]
    stack: bool = False


def rate(metric: str, matchers: str, by: str) -> str:
    return f"sum by ({by}) (rate({metric}{{{matchers}}}[$__rate_interval]))"


def quantiles(metric: str, matchers: str = ROUTE) -> tuple[Target, ...]:
    """p50 and p99 of a histogram, per route."""
    return tuple(
        Target(
            expr=f"histogram_quantile({q}, {rate(metric + '_bucket', matchers, 'le, route')})",
            legend=f"{{{{route}}}} p{round(q * 100)}",
        )
        for q in (0.5, 0.99)
    )


# The inbox's gauges are read from the database: every pod reports the same value for a route,
# so take the max, never the sum (deploy/prometheus/rules.yaml does the same).
def inbox(metric: str, legend: str = "{{route}}") -> Target:
    return Target(expr=f"max by (route) ({metric}{{{ROUTE}}})", legend=legend)


ROWS: tuple[tuple[str, tuple[Panel, ...]], ...] = (
    (
        "Requests",
        (
            Panel(
                title="Requests by outcome",
                description="Webhooks answered, by outcome (dedup_requests_total; "
                "docs/operations.md, Metrics). processed: forwarded once and committed; queued, "
                "dead_letter: kept by redeliver; unavailable: the proxy's own 503s.",
                unit="reqps",
                stack=True,
                targets=(
                    Target(
                        expr=rate("dedup_requests_total", ROUTE, "outcome"), legend="{{outcome}}"
                    ),
                ),
            ),
            Panel(
                title="Duplicates",
                description="Copies of events already claimed, answered without reaching the app; "
                "and duplicates whose body differs from the first copy's (a replay, or an ID that "
                "is not per event).",
                unit="reqps",
                targets=(
                    Target(
                        expr=rate(
                            "dedup_requests_total",
                            f'outcome=~"duplicate|duplicate_queued", {ROUTE}',
                            "route, outcome",
                        ),
                        legend="{{route}} {{outcome}}",
                    ),
                    Target(
                        expr=rate("dedup_payload_mismatches_total", ROUTE, "route"),
                        legend="{{route}} body differs",
                    ),
                ),
            ),
            Panel(
                title="In flight",
                description="Webhook requests being processed (dedup_in_flight_requests).",
                unit="short",
                targets=(
                    Target(
                        expr=f"sum by (route) (dedup_in_flight_requests{{{ROUTE}}})",
                        legend="{{route}}",
                    ),
                ),
            ),
            Panel(
                title="Shed requests by reason",
                description="Requests answered 503, or connections refused or closed, to keep a "
                "worker within its limits: memory (max_buffered), connections (max_connections), "
                "pool (no database connection).",
                unit="reqps",
                targets=(
                    Target(
                        expr=rate("dedup_shed_requests_total", INSTANCE, "reason"),
                        legend="{{reason}}",
                    ),
                ),
            ),
            Panel(
                title="Buffered bytes",
                description="Request bodies and app answers held in memory, against max_buffered "
                "(per worker).",
                unit="bytes",
                targets=(
                    Target(
                        expr=f"sum by (instance) (dedup_buffered_bytes{{{INSTANCE}}})",
                        legend="{{instance}}",
                    ),
                ),
            ),
            Panel(
                title="Claims in doubt",
                description="COMMITs after an app's 2xx that failed and could not be reconciled "
                "(ambiguous), or were never sent (the claim is absent): the event's next copy may "
                "reach the app again. Alerts: DedupAmbiguousCommit, DedupCommitNotSent.",
                unit="short",
                targets=(
                    Target(
                        expr=f"sum by (route) (increase(dedup_ambiguous_commits_total{{{ROUTE}}}"
                        "[$__rate_interval]))",
                        legend="{{route}} ambiguous",
                    ),
                    Target(
                        expr=f"sum by (route) (increase(dedup_unsent_commits_total{{{ROUTE}}}"
                        "[$__rate_interval]))",
                        legend="{{route}} not sent",
                    ),
                ),
            ),
        ),
    ),
    (
        "Latency by phase",
        (
            Panel(
                title="Request duration",
                description="From the request's headers to the proxy's answer, the body's arrival "
                "included (dedup_request_duration_seconds).",
                unit="s",
                targets=quantiles("dedup_request_duration_seconds"),
            ),
            Panel(
                title="Claim",
                description="Time to obtain the claim, waiting for a copy in flight included "
                "(dedup_claim_wait_seconds).",
                unit="s",
                targets=quantiles("dedup_claim_wait_seconds"),
            ),
            Panel(
                title="Upstream",
                description="Time for the app to answer (dedup_upstream_duration_seconds).",
                unit="s",
                targets=quantiles("dedup_upstream_duration_seconds"),
            ),
            Panel(
                title="Commit",
                description="Time for PostgreSQL to COMMIT a claim after the app's 2xx "
                "(dedup_commit_duration_seconds).",
                unit="s",
                targets=quantiles("dedup_commit_duration_seconds"),
            ),
        ),
    ),
    (
        "Database",
        (
            Panel(
                title="Connection pool",
                description="Database connections open and lent out, per pod (its workers' added "
                "up). Alert: DedupDatabasePoolSaturated.",
                unit="short",
                targets=(
                    Target(
                        expr=f"sum by (instance) (dedup_database_connections{{{INSTANCE}}})",
                        legend="{{instance}} open",
                    ),
                    Target(
                        expr=f"sum by (instance) (dedup_database_connections_in_use{{{INSTANCE}}})",
                        legend="{{instance}} in use",
                    ),
                ),
            ),
            Panel(
                title="Connects by result",
                description="Connections to PostgreSQL: opened, failed (refused or timed out), "
                "backed_off (not tried after failures: answered 503 at once).",
                unit="ops",
                targets=(
                    Target(
                        expr=rate("dedup_database_connects_total", INSTANCE, "result"),
                        legend="{{result}}",
                    ),
                ),
            ),
            Panel(
                title="Database health",
                description="commits replicated: 1 when COMMITs wait for a standby, 0 when a "
                "failover can lose acknowledged claims. grant missing: 1 while the role lacks a "
                "grant besides the claim's (Alert: DedupGrantMissing). Readiness (/readyz) is a "
                "probe, not a metric: graph Prometheus's up for the scrape.",
                unit="short",
                targets=(
                    Target(
                        expr=f"min by (instance) (dedup_database_commits_replicated{{{INSTANCE}}})",
                        legend="{{instance}} commits replicated",
                    ),
                    Target(
                        expr=f"max by (grant) (dedup_database_grant_missing{{{INSTANCE}}})",
                        legend="grant missing: {{grant}}",
                    ),
                ),
            ),
        ),
    ),
    (
        "Flow control",
        (
            Panel(
                title="At the app against the limit",
                description="Webhooks at the app now (first deliveries and redeliveries, not "
                "pass-through) against upstream.concurrency: at the limit, a redeliver route keeps "
                "what arrives and other routes wait their turn.",
                unit="short",
                targets=(
                    Target(expr=f"sum(dedup_app_in_flight{{{INSTANCE}}})", legend="at the app"),
                    Target(expr=f"sum(dedup_app_limit{{{INSTANCE}}})", legend="limit"),
                ),
            ),
            Panel(
                title="Kept by reason",
                description="Deliveries kept for the redeliverer (202): failed (the app failed "
                "it), limit (no room at the app), deadline (no answer by the route's hand_off), "
                "paused, retry_after. Alert: DedupAppOverflow.",
                unit="ops",
                stack=True,
                targets=(
                    Target(
                        expr=rate("dedup_inbox_kept_total", ROUTE, "route, reason"),
                        legend="{{route}} {{reason}}",
                    ),
                ),
            ),
            Panel(
                title="Answered by the app, kept unsent",
                description="Per route: webhooks the app answered at once (processed or "
                "upstream_error) against those kept unsent, for want of a place or past the "
                "route's hand_off. Under a load the app can carry, all but bursts are answered "
                "at once. Alert: DedupKeptWithRoomAtApp.",
                unit="ops",
                targets=(
                    Target(
                        expr=rate(
                            "dedup_requests_total",
                            f'outcome=~"processed|upstream_error", {ROUTE}',
                            "route",
                        ),
                        legend="{{route}} by the app",
                    ),
                    Target(
                        expr=rate(
                            "dedup_inbox_kept_total", f'reason=~"limit|deadline", {ROUTE}', "route"
                        ),
                        legend="{{route}} kept unsent",
                    ),
                ),
            ),
            Panel(
                title="Waits for room",
                description="Webhooks and redeliveries that waited for room at the app (a "
                "webhook of a redeliver route 0.5 s at most, then it is kept).",
                unit="ops",
                targets=(
                    Target(
                        expr=f"sum(rate(dedup_app_waits_total{{{INSTANCE}}}[$__rate_interval]))",
                        legend="waits",
                    ),
                ),
            ),
        ),
    ),
    (
        "Inbox (redeliver)",
        (
            Panel(
                title="Inbox backlog",
                description="Deliveries kept for redelivery, not yet delivered; and those given up "
                "on (dead), kept for an operator (dedup-proxy events).",
                unit="short",
                targets=(
                    inbox("dedup_inbox_pending", "{{route}} pending"),
                    inbox("dedup_inbox_dead", "{{route}} dead"),
                ),
            ),
            Panel(
                title="Inbox backlog bytes",
                description="Bytes of the bodies kept for redelivery, against max_pending_bytes.",
                unit="bytes",
                targets=(inbox("dedup_inbox_pending_bytes"),),
            ),
            Panel(
                title="Inbox age",
                description="The oldest pending delivery's age; how long the most overdue one has "
                "been due (above a few poll intervals redelivery is stuck: DedupRedeliveryStuck); "
                "how long the oldest dead one has waited for an operator; on routes with order, "
                "the oldest blocked object's head (DedupObjectBlocked past 30 minutes).",
                unit="s",
                targets=(
                    inbox("dedup_inbox_oldest_pending_seconds", "{{route}} oldest pending"),
                    inbox("dedup_inbox_overdue_seconds", "{{route}} most overdue"),
                    inbox("dedup_inbox_oldest_dead_seconds", "{{route}} oldest dead"),
                    inbox("dedup_ordering_oldest_blocked_seconds", "{{route}} oldest blocked"),
                ),
            ),
            Panel(
                title="Blocked objects",
                description="On routes with order: objects whose oldest pending delivery holds "
                "later deliveries of them behind (dedup-proxy events blocked lists them). Alert: "
                "DedupObjectBlocked, once the oldest has held them for 30 minutes (Inbox age: "
                "oldest blocked).",
                unit="short",
                targets=(inbox("dedup_ordering_blocked_objects", "{{route}} blocked"),),
            ),
            Panel(
                title="Dead letters",
                description="Deliveries given up on: at the first try (an answer retrying cannot "
                "fix, outcome dead_letter) or at a redelivery (result dead). Alert: "
                "DedupDeadLetters.",
                unit="ops",
                targets=(
                    Target(
                        expr=rate(
                            "dedup_requests_total", f'outcome="dead_letter", {ROUTE}', "route"
                        ),
                        legend="{{route}} at the first try",
                    ),
                    Target(
                        expr=rate("dedup_redeliveries_total", f'result="dead", {ROUTE}', "route"),
                        legend="{{route}} at a redelivery",
                    ),
                ),
            ),
            Panel(
                title="Redeliveries by result",
                description="delivered (a 2xx), failed (tried again later), dead (given up on).",
                unit="ops",
                stack=True,
                targets=(
                    Target(
                        expr=rate("dedup_redeliveries_total", ROUTE, "route, result"),
                        legend="{{route}} {{result}}",
                    ),
                ),
            ),
            Panel(
                title="Failures not kept",
                description="Failed deliveries relayed to the provider instead of kept: the inbox "
                "at its cap, a body kept already under another event ID, or the database failing "
                "while keeping them.",
                unit="ops",
                targets=(
                    Target(
                        expr=rate("dedup_inbox_full_total", ROUTE, "route"),
                        legend="{{route}} inbox full",
                    ),
                    Target(
                        expr=rate("dedup_inbox_replays_total", ROUTE, "route"),
                        legend="{{route}} body kept already",
                    ),
                    Target(
                        expr=rate("dedup_inbox_keep_failures_total", ROUTE, "route"),
                        legend="{{route}} database failed",
                    ),
                ),
            ),
        ),
    ),
    (
        "Silent losses",
        (
            Panel(
                title="Refused by the proxy",
                description="The share of a route's requests the proxy answered 4xx itself "
                "(outcome rejected: a signature that does not verify, an event ID missing, a body "
                "over max_body): nothing is claimed or kept, and a sender like GitHub never "
                "retries. A rotated secret makes it all of them. Alert: DedupRequestsRejected.",
                unit="percentunit",
                targets=(
                    Target(
                        expr=rate("dedup_requests_total", f'outcome="rejected", {ROUTE}', "route")
                        + " / "
                        + rate("dedup_requests_total", ROUTE, "route"),
                        legend="{{route}} refused",
                    ),
                ),
            ),
            Panel(
                title="Routes held",
                description="1 while a route is held: paused (events pause) or by the app's "
                "Retry-After; its redeliveries wait, and a route without redeliver answers 503. "
                "Alert: DedupRoutePausedTooLong, past 4 hours or past the end asked for.",
                unit="short",
                targets=(
                    Target(
                        expr=f"max by (route, reason) (dedup_route_held{{{ROUTE}}})",
                        legend="{{route}} {{reason}}",
                    ),
                ),
            ),
            Panel(
                title="Receipts",
                description="Looks at the app's receipts on routes with receipt, by what they "
                "found: written, absent, undecided, and missing (a 2xx without a receipt: a COMMIT "
                "in doubt is then not settled by it). Alert: DedupReceiptsMissing.",
                unit="ops",
                targets=(
                    Target(
                        expr=rate("dedup_receipts_total", ROUTE, "route, result"),
                        legend="{{route}} {{result}}",
                    ),
                ),
            ),
            Panel(
                title="Reconcile: gaps and recoveries",
                description="Events the provider reports it failed to deliver and no claim holds "
                "(found again by each run until recovered), and those recovered. Alert: "
                "DedupReconcileGapsPersist.",
                unit="ops",
                targets=(
                    Target(
                        expr=rate("dedup_reconcile_gaps_total", ROUTE, "route"),
                        legend="{{route}} gaps found",
                    ),
                    Target(
                        expr=rate("dedup_reconcile_recovered_total", ROUTE, "route"),
                        legend="{{route}} recovered",
                    ),
                ),
            ),
            Panel(
                title="Reconcile: since the last run",
                description="How long since a reconcile run of the route last completed, on any "
                "replica. Alert: DedupReconcileFailing, past 15 minutes (3 periods of the default "
                "every).",
                unit="s",
                targets=(
                    Target(
                        expr="time() - max by (route) "
                        f"(dedup_reconcile_last_success_timestamp_seconds{{{ROUTE}}})",
                        legend="{{route}}",
                    ),
                ),
            ),
        ),
    ),
)


def variables() -> list[dict[str, Any]]:
    """The template variables: the Prometheus data source, then instance and route."""

    def query(name: str, label: str, metric: str) -> dict[str, Any]:
        return {
            "name": name,
            "label": label,
            "type": "query",
            "datasource": DATASOURCE,
            "definition": metric,
            "query": metric,
            "refresh": 2,  # on a change of the time range
            "includeAll": True,
            "allValue": ".*",
            "multi": True,
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
            "sort": 1,
        }

    return [
        {
            "name": "datasource",
            "label": "Data source",
            "type": "datasource",
            "query": "prometheus",
            "current": {},
        },
        query("instance", "Instance", "label_values(dedup_build_info, instance)"),
        query("route", "Route", f"label_values(dedup_requests_total{{{INSTANCE}}}, route)"),
    ]


def panel_json(panel: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    custom: dict[str, Any] = {"fillOpacity": 10, "showPoints": "never"}
    if panel.stack:
        custom["stacking"] = {"mode": "normal", "group": "A"}
    return {
        "id": panel_id,
        "type": "timeseries",
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {"h": HEIGHT, "w": WIDTH, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": panel.unit, "custom": custom}, "overrides": []},
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": [
            {
                "datasource": DATASOURCE,
                "refId": chr(ord("A") + index),
                "expr": target.expr,
                "legendFormat": target.legend,
                "range": True,
            }
            for index, target in enumerate(panel.targets)
        ],
    }


def panels() -> list[dict[str, Any]]:
    """Each row's title, then its panels, PER_LINE to a line."""
    laid: list[dict[str, Any]] = []
    y = 0
    for title, row in ROWS:
        laid.append({
            "id": len(laid) + 1, "type": "row", "title": title, "collapsed": False,
            "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": [],
        })  # fmt: skip
        y += 1
        for index, panel in enumerate(row):
            column = index % PER_LINE
            laid.append(panel_json(panel, len(laid) + 1, column * WIDTH, y))
            if column == PER_LINE - 1 or index == len(row) - 1:
                y += HEIGHT
    return laid


def dashboard() -> dict[str, Any]:
    return {
        "uid": UID,
        "title": "dedup-proxy",
        "description": "Webhooks taken once: requests, duplicates, latency by phase, the "
        "database, the inbox (redeliver). Generated by deploy/grafana/dashboard.py.",
        "tags": ["dedup-proxy", "webhooks"],
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,  # a shared crosshair
        "time": {"from": "now-6h", "to": "now"},
        "refresh": "30s",
        "timezone": "browser",
        "templating": {"list": variables()},
        "annotations": {"list": []},
        "links": [],
        "panels": panels(),
    }


def json_text() -> str:
    return json.dumps(dashboard(), indent=2, ensure_ascii=False) + "\n"


def config_map_text() -> str:
    """The dashboard in a ConfigMap for Grafana's sidecar, which loads every ConfigMap labelled
    grafana_dashboard: "1" in the namespaces it searches."""
    indented = "".join(f"    {line}" for line in json_text().splitlines(True))
    return (
        "# GENERATED by deploy/grafana/dashboard.py --write (deploy/check-manifests checks\n"
        "# that it agrees): edit the dashboard there. Grafana's dashboard sidecar\n"
        "# (kube-prometheus-stack's grafana.sidecar.dashboards) loads the ConfigMaps labelled\n"
        '# grafana_dashboard: "1" from its own namespace, or from every one with\n'
        "# searchNamespace: ALL (docs/operations.md, Dashboard).\n"
        "apiVersion: v1\n"
        "kind: ConfigMap\n"
        "metadata:\n"
        "  name: dedup-proxy-dashboard\n"
        "  labels:\n"
        "    app.kubernetes.io/name: webhook-receiver\n"
        '    grafana_dashboard: "1"\n'
        "data:\n"
        "  dedup-proxy.json: |\n" + indented
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="write the JSON and the ConfigMap")
    args = parser.parse_args()
    if not args.write:
        sys.stdout.write(json_text())
        return 0
    for path, text in ((JSON_FILE, json_text()), (CONFIG_MAP_FILE, config_map_text())):
        path.write_text(text, encoding="utf-8")
        print(f"dashboard.py: wrote {path.relative_to(HERE.parent.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
