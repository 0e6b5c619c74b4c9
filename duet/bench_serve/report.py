"""What a `duet bench serve` run leaves: the printed table, the JSON summary (`--json`), the records (`--records`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from duet.bench_serve.metrics import LATENCY_KEYS
from duet.bench_serve.request_record import RequestRecord

SUMMARY_KEYS = ("requests", "completed", "failed", "duration_s", "output_tokens_per_s", *LATENCY_KEYS, "goodput_rps",
                "slo_attainment")
_LATENCY_NAMES = {"ttft_ms": "TTFT", "tpot_ms": "TPOT", "itl_ms": "ITL", "e2e_ms": "E2E"}


def format_table(summary: dict) -> str:
    """Two Markdown tables: the run's counts and rates, then each latency's percentiles in ms."""
    s = summary
    lines = ["| requests | completed | failed | duration s | output tok/s | goodput req/s | SLO attainment |",
             "|---:|---:|---:|---:|---:|---:|---:|",
             f"| {s['requests']} | {s['completed']} | {s['failed']} | {s['duration_s']:.2f} "
             f"| {s['output_tokens_per_s']:.1f} | {s['goodput_rps']:.2f} | {s['slo_attainment']:.3f} |",
             "",
             "| latency ms | p50 | p90 | p99 | mean |",
             "|---|---:|---:|---:|---:|"]
    for key in LATENCY_KEYS:
        stats = s[key]
        cells = " | ".join("-" if stats[s] is None else f"{stats[s]:.2f}" for s in ("p50", "p90", "p99", "mean"))
        lines.append(f"| {_LATENCY_NAMES[key]} | {cells} |")
    return "\n".join(lines)


def summary_json(summary: dict, config: dict, records: Sequence[RequestRecord]) -> dict:
    """--json's object: the summary's keys, then `config` and `records`."""
    return {**{key: summary[key] for key in SUMMARY_KEYS}, "config": config,
            "records": [r.to_json() for r in records]}


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=1) + "\n")


def write_records(path: Path, records: Sequence[RequestRecord]) -> None:
    """One JSON object per line, in request_index order."""
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r.to_json()) + "\n")


def read_records(path: Path) -> list[RequestRecord]:
    with open(path) as f:
        return [RequestRecord.from_json(json.loads(line)) for line in f if line.strip()]
