"""The tracing calls one new webhook makes, timed alone in this process: off (``NOT_TRACED``),
on with a sampler of 0, and on at 100 % (spans made and queued; the export, on the SDK's
thread, is bench/tracing_cost.py's to measure).

    python bench/tracing_calls.py [--count 20000]

No server, no database: the pipeline's calls for a new event (the SERVER span, the claim's
INSERT span, the forward's CLIENT span with its headers injected, the COMMIT span, the end
with the log line's facts), as ``proxy/pipeline.py`` makes them, in a loop; each mode in a
child process of its own (the SDK reads its variables once), the median of ``--rounds``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ROOT = Path(__file__).resolve().parent.parent
# The export never happens during the loop: a queue larger than the loop, a minute's delay.
QUIET = {"OTEL_BSP_MAX_QUEUE_SIZE": "10000000", "OTEL_BSP_SCHEDULE_DELAY": "60000"}
ENDPOINT = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:9/v1/traces", **QUIET}
MODES = {
    "off": {},
    "on, sampler 0": {**ENDPOINT, "OTEL_TRACES_SAMPLER": "traceidratio",
                      "OTEL_TRACES_SAMPLER_ARG": "0"},
    "on, 100 %": {**ENDPOINT, "OTEL_TRACES_SAMPLER": "always_on"},
}  # fmt: skip


def one_mode(count: int) -> None:
    """Print the microseconds per webhook of the tracing calls in this process's environment,
    then exit."""
    from aiohttp.test_utils import make_mocked_request
    from multidict import CIMultiDict

    from proxy import tracing
    from proxy.upstream import proxy_headers

    traces = tracing.Tracing(
        tracing.wanted(os.environ), proxy_headers.TrustedProxies(), "processed_events"
    )
    traces.open()
    request = make_mocked_request(
        "POST", "/webhooks/stripe",
        headers={"Host": "proxy:8080", "User-Agent": "Stripe/1.0 (+https://stripe.com)",
                 "Content-Type": "application/json; charset=utf-8"},
    )  # fmt: skip

    def webhook() -> None:
        line: dict[str, object] = {}
        trace = traces.begin(request, "stripe", "/webhooks/stripe", line)  # type: ignore[arg-type]
        span = trace.database("claim", "INSERT")
        trace.end(span, {"dedup.acquired": True})
        headers = CIMultiDict({"Content-Type": "application/json", "X-Request-Id": "a" * 32})
        forward = trace.forwarding("POST", "http://127.0.0.1:3000", "/webhooks/stripe", headers)
        trace.answered(forward, 200, 0)
        span = trace.database("commit", "COMMIT")
        trace.end(span)
        line.update(status=200, outcome="processed", event_id="evt_1", claim_ms=1.2)
        trace.finish(line)  # type: ignore[arg-type]

    for _ in range(count // 10):
        webhook()
    started = time.perf_counter()
    for _ in range(count):
        webhook()
    took = (time.perf_counter() - started) / count * 1e6
    print(json.dumps(took), flush=True)
    os._exit(0)  # at once: the SDK's thread holds the spans, never to be exported


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        one_mode(args.count)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    results: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode, env in MODES.items():
            done = subprocess.run(
                [sys.executable, __file__, "--one", "--count", str(args.count)],
                env={**clean, **env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                check=True, timeout=300,
            )  # fmt: skip
            results[mode].append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"`python bench/tracing_calls.py --count {args.count} --rounds {args.rounds}`\n")
    print("| tracing | µs per webhook (median) | rounds |\n|---|---|---|")
    for mode, values in results.items():
        shown = ", ".join(f"{value:.1f}" for value in values)
        print(f"| {mode} | {statistics.median(values):.1f} | {shown} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
