"""The words a kept row and a hold are told in, the console's and the CLI's alike: one masking
policy for headers (the request's and the app's answer's), the hold in one line, the attempts'
facts escaped."""

from __future__ import annotations

from datetime import UTC, datetime

from proxy import database, inbox_commands, presenting
from proxy.database import inbox


def test_a_credential_a_token_or_a_signature_is_shown_as_its_size_only() -> None:
    shown = dict(
        presenting.shown_headers(
            [
                ("Authorization", "Bearer secret-token"),
                ("Stripe-Signature", "t=1,v1=" + "ab" * 32),
                ("X-Hub-Signature-256", "sha256=ff"),
                # GitLab sends the webhook's secret itself: the CLI printed it whole before.
                ("X-Gitlab-Token", "glsecret"),
                ("X-Api-Key", "k"),
                ("Cookie", "session=1"),
                ("Content-Type", "application/json"),
            ]
        )
    )
    assert shown == {
        "Authorization": "<redacted 19 bytes>",
        "Stripe-Signature": "<redacted 71 bytes>",
        "X-Hub-Signature-256": "<redacted 9 bytes>",
        "X-Gitlab-Token": "<redacted 8 bytes>",
        "X-Api-Key": "<redacted 1 bytes>",
        "Cookie": "<redacted 9 bytes>",
        "Content-Type": "application/json",
    }


def test_an_apps_answer_is_masked_and_escaped_as_the_request_is() -> None:
    kept = [
        {"n": 3, "at": "2026-12-01T02:14:07+00:00", "status": 503, "ms": 12.5,
         "headers": [["X-Upstream-Token", "t0k3n"], ["X-Evil", "a\x1b[2Jb"]],
         "body": "line\x07one\nline two", "body_bytes": 4096},
        {"at": "not a time", "error": "upstream\x1b]52;c; did not answer", "ms": 30001.3},
    ]  # fmt: skip

    first, second = presenting.attempts(kept, presenting.when)

    assert (first.n, first.at, first.status) == (3, "2026-12-01T02:14:07+00:00", 503)
    assert first.headers == [("X-Upstream-Token", "<redacted 5 bytes>"), ("X-Evil", "a\\u001b[2Jb")]
    assert first.body_lines == ["line\\u0007one", "line two"]
    assert (first.body_bytes, first.cut) == (4096, True)
    assert (second.n, second.at, second.body_bytes) == (2, "not a time", None)
    assert second.error == "upstream\\u001b]52;c; did not answer"
    printed = inbox_commands.shown_json(_shown(kept))["attempts"][0]["headers"]
    assert printed == [["X-Upstream-Token", None], ["X-Evil", "a\x1b[2Jb"]]


def _shown(attempts: list[dict[str, object]]) -> inbox.Shown:
    at = datetime(2026, 12, 1, tzinfo=UTC)
    return inbox.Shown(
        scope="hooks", event_id="e", event_type=None, received_at=at, state="dead", due=None,
        until=None, changed=at, request=None, body_bytes=None, attempts=attempts,
    )  # fmt: skip


def test_a_hold_is_worded_alike_on_a_page_and_a_terminal() -> None:
    since = datetime(2026, 12, 3, 22, tzinfo=UTC).timestamp()
    pause = database.Hold(
        reason=database.HoldKind.PAUSED, until=since + 7200, since=since, by="alice\x1b[2J",
        asked_until=since + 7200, note="app maintenance",
    )  # fmt: skip
    retry = database.Hold(
        reason=database.HoldKind.RETRY_AFTER, until=None, since=since, by="proxy",
        asked_until=None,
    )  # fmt: skip

    assert presenting.hold(pause, since + 60, presenting.page_when) == (
        "paused by alice\\u001b[2J since 2026-12-03 22:00:00, until 2026-12-04 00:00:00 "
        "(1h 59m left): app maintenance"
    )
    assert presenting.hold(retry, since, presenting.when, "stripe") == (
        "scope stripe held for the app's Retry-After since 2026-12-03T22:00:00+00:00, until resumed"
    )


def test_states_and_last_answers_are_worded_once() -> None:
    assert presenting.state(None) == "delivered at the first try"
    assert presenting.state("dead") == "dead"
    assert presenting.last(503, "ignored") == "503"
    assert presenting.last(None, None) == "-"
    assert presenting.last(None, "connect\n  refused " + "x" * 80) == (
        "connect refused " + "x" * 43 + "…"
    )
    assert presenting.age(7140) == "1h 59m"
    assert presenting.age(None) == "-"
