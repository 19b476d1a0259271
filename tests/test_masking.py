"""Masking of passwords in log lines: linear in the line, and the OTLP endpoint's token."""

from __future__ import annotations

from proxy import logs, tracing


def test_masking_a_line_of_url_prefixes_without_an_at_sign_finishes() -> None:
    # About 250 s under the regex that rescanned the rest of the line from each "://"
    # (pytest-timeout stops it at 120 s); a fraction of a second scanned once.
    line = "GET /" + "postgres://a:" * 60_000 + " @"
    assert logs.mask(line) == line


def test_a_url_password_after_many_prefixes_is_still_masked() -> None:
    line = "x " + "postgres://a:" * 1_000 + "s3cr3t@db/app y"
    assert "s3cr3t" not in logs.mask(line)
    assert logs.mask(line).endswith("***@db/app y")


def test_the_tracing_line_shows_the_endpoint_without_its_query_or_password() -> None:
    described = tracing.describe(
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "https://u:pw@otel:4318/x?api_key=SECRET#frag"}
    )
    assert described == "OTEL_EXPORTER_OTLP_ENDPOINT=https://u:***@otel:4318/x"
