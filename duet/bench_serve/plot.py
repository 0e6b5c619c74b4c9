"""`--plot OUT.png`: the latency CDFs (TTFT, TPOT, E2E) and output throughput over time, from the records.

matplotlib is an optional dependency (`pip install 'duet[plot]'`); the command checks for it before the run.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from duet.bench_serve.metrics import latency_samples, throughput_bins
from duet.bench_serve.request_record import RequestRecord

THROUGHPUT_BIN_S = 1.0


def plot_run(path: Path, records: Sequence[RequestRecord], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    samples = latency_samples(records)
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, key, name in zip(axes.flat, ("ttft_ms", "tpot_ms", "e2e_ms"), ("TTFT", "TPOT", "E2E latency")):
        values = np.sort(np.asarray(samples[key], dtype=np.float64))
        if len(values):
            ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post")
        ax.set(title=f"{name} CDF ({len(values)} requests)", xlabel="ms", ylabel="fraction of requests", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    ax = axes.flat[3]
    bins = throughput_bins(records, THROUGHPUT_BIN_S)
    ax.bar(np.arange(len(bins)) * THROUGHPUT_BIN_S, bins, width=THROUGHPUT_BIN_S, align="edge")
    ax.set(title=f"output throughput ({THROUGHPUT_BIN_S:g} s bins)", xlabel="s since the run's start",
           ylabel="tokens/s")
    ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
