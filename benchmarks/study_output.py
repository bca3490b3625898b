"""What a study script prints and writes at the end: its table as Markdown and its JSON
summary (arguments, table rows, every run)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def write_summary(
    out: Path, args: argparse.Namespace, rows: list[dict[str, Any]], runs: list[dict[str, Any]]
) -> None:
    """Print ``rows`` as a Markdown table (columns in first-seen order) and write
    ``out.json``."""
    cols = list(dict.fromkeys(c for row in rows for c in row))
    print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for row in rows:
        print("| " + " | ".join(str(row.get(c, "-")) for c in cols) + " |")
    summary = {"args": vars(args), "table": rows, "runs": runs}
    out.with_suffix(".json").write_text(json.dumps(summary, indent=1))
