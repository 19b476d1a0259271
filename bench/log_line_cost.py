"""What a webhook's canonical log line costs: through the logging chain and the short way.

    python bench/log_line_cost.py [--lines 20000] [--rounds 4]

The proxy's own log set-up (JSON, a worker's number) writing to /dev/null; one request's
fields, as the pipeline logs them; ``logger.log`` (a record, the filters, the handler chain)
against ``logs.line`` (the short way the pipeline takes), alternately, in microseconds per line.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from proxy import config, logs

FIELDS = {
    "route": "stripe", "scope": "stripe", "method": "POST", "path": "/webhooks/stripe",
    "request_id": "9f" * 16, "event_id": "evt_1QhXfLLkdIwHu7ix2tjW4cQx",
    "event_type": "charge.succeeded", "outcome": "processed", "claim_ms": 0.31,
    "upstream_ms": 1.22, "commit_ms": 0.41, "upstream_status": 200, "status": 200,
    "total_ms": 2.31, "trace_id": None,
}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args(argv)
    with open("/dev/null", "w", encoding="utf-8") as sink:
        logs.setup(config.LogConfig(level="info", format="json"), stream=sink, worker=1)
        logger = logging.getLogger("proxy.pipeline")
        message = "POST /webhooks/stripe -> processed"

        def chain() -> None:
            logger.log(logging.INFO, "%s", message, extra={"fields": FIELDS})

        def short() -> None:
            logs.line(logger, logging.INFO, message, FIELDS)

        timings: dict[str, list[float]] = {"the logging chain": [], "the short way": []}
        for _ in range(args.rounds):
            for name, write in (("the logging chain", chain), ("the short way", short)):
                started = time.perf_counter()
                for _ in range(args.lines):
                    write()
                timings[name].append((time.perf_counter() - started) / args.lines * 1e6)
    print("| way | µs per line, median | rounds |")
    print("|---|---|---|")
    for name, values in timings.items():
        each = ", ".join(f"{v:.1f}" for v in values)
        print(f"| {name} | {statistics.median(values):.1f} | {each} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
