"""The seed's chart: throughput per GPU against interactivity, each point labelled with its concurrency."""

from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")  # no display; must precede pyplot
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib import ticker  # noqa: E402

from .loadgen import LoadSweep  # noqa: E402

CHART_DPI = 120
MARKERS = ("o", "s", "^", "D")


def draw_chart(sweeps: list[LoadSweep]) -> bytes:
    """PNG bytes: left, tokens/min/GPU against output tokens/s per user; right, TTFT p50 against users."""
    fig, (ax, ax_ttft) = plt.subplots(1, 2, figsize=(12, 5), gridspec_kw={"width_ratios": [3, 2]})
    for k, sweep in enumerate(sweeps):
        pts = [p for p in sweep.points if p.interactivity_tok_s is not None]
        xs = [p.interactivity_tok_s for p in pts]
        ys = [p.throughput_tok_min_gpu for p in pts]
        line, = ax.plot(xs, ys, marker=MARKERS[k % len(MARKERS)], label=sweep.label)
        for p, x, y in zip(pts, xs, ys):
            ax.annotate(str(p.concurrency), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8,
                        color=line.get_color())
        tt = [p for p in sweep.points if p.ttft_p50_s is not None]
        ax_ttft.plot([p.concurrency for p in tt], [p.ttft_p50_s for p in tt], marker=MARKERS[k % len(MARKERS)],
                     color=line.get_color(), label=f"{sweep.label} p50")
        ax_ttft.plot([p.concurrency for p in tt], [p.ttft_p99_s for p in tt], linestyle="--",
                     color=line.get_color(), label=f"{sweep.label} p99")
    ax.set_xlabel("interactivity (output tokens/s per user)")
    ax.set_ylabel("throughput (tokens/min per GPU, input + output)")
    ax.set_title("Throughput vs interactivity (labels: concurrent sessions)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax_ttft.set_xlabel("concurrent sessions")
    ax_ttft.set_ylabel("time to first token (s)")
    ax_ttft.set_xscale("log", base=2)
    ax_ttft.xaxis.set_major_formatter(ticker.ScalarFormatter())  # 1, 2, 4 ... rather than 2^k
    ax_ttft.set_title("TTFT")
    ax_ttft.grid(True, alpha=0.3)
    ax_ttft.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=CHART_DPI)
    plt.close(fig)
    return buf.getvalue()
