"""``python -m proxy``: the same as the ``dedup-proxy`` command."""

from __future__ import annotations

import sys

from proxy import cli

sys.exit(cli.main())
