"""The benchmark report: a side-by-side table, a JSON file and an optional PNG plot."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from client.bench.metrics import LevelResult

# The goal for this 2-core CPU: aggregate throughput at C=8 at least 5x C=1.
SCALING_TARGET = (8, 5.0)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def _baseline(ours: Sequence[LevelResult]) -> LevelResult | None:
    return min(ours, key=lambda level: level.concurrency, default=None)


def comparison_rows(
    ours: Sequence[LevelResult], peers: Mapping[str, Sequence[LevelResult]]
) -> list[dict[str, Any]]:
    """One row per concurrency level: our figures, each peer's tok/s and our ratio to it."""
    base = _baseline(ours)
    rows = []
    for level in ours:
        summary = level.summary()
        row: dict[str, Any] = {
            "concurrency": level.concurrency,
            "ours_tokens_per_second": level.tokens_per_second,
            "ours_requests_per_second": summary["requests_per_second"],
            "ours_errors": summary["errors"],
            "ttft_p50": summary["ttft_p50"],
            "ttft_p95": summary["ttft_p95"],
            "itl_p50": summary["itl_p50"],
            "itl_p95": summary["itl_p95"],
            "scaling_vs_lowest_c": (
                level.tokens_per_second / base.tokens_per_second
                if base and base.tokens_per_second
                else None
            ),
        }
        for name, results in peers.items():
            peer = next((p for p in results if p.concurrency == level.concurrency), None)
            peer_rate = peer.tokens_per_second if peer else None
            row[f"{name}_tokens_per_second"] = peer_rate
            row[f"ours_over_{name}"] = level.tokens_per_second / peer_rate if peer_rate else None
        rows.append(row)
    return rows


def format_table(rows: Sequence[Mapping[str, Any]], peer_names: Sequence[str]) -> str:
    header = ["C", "ours tok/s", "req/s", "TTFT p50", "TTFT p95", "ITL p50", "ITL p95"]
    for name in peer_names:
        header += [f"{name} tok/s", f"ours/{name}"]
    header.append("scaling")
    lines = []
    for row in rows:
        cells = [
            str(row["concurrency"]),
            f"{row['ours_tokens_per_second']:.1f}",
            f"{row['ours_requests_per_second']:.2f}",
            _ms(row["ttft_p50"]),
            _ms(row["ttft_p95"]),
            _ms(row["itl_p50"]),
            _ms(row["itl_p95"]),
        ]
        for name in peer_names:
            rate, ratio = row[f"{name}_tokens_per_second"], row[f"ours_over_{name}"]
            cells += [
                "-" if rate is None else f"{rate:.1f}",
                "-" if ratio is None else f"{ratio:.2f}x",
            ]
        scaling = row["scaling_vs_lowest_c"]
        cells.append("-" if scaling is None else f"{scaling:.2f}x")
        lines.append(cells)
    widths = [max(len(r[i]) for r in [header, *lines]) for i in range(len(header))]
    out = ["  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True))]
    out += ["  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)) for cells in lines]
    out.append("(latencies in ms; scaling = ours tok/s over ours at the lowest C)")
    return "\n".join(out)


def scaling_verdict(ours: Sequence[LevelResult]) -> str | None:
    """The issue's C=8 vs C=1 check, when both levels ran."""
    target_c, target_gain = SCALING_TARGET
    by_c = {level.concurrency: level.tokens_per_second for level in ours}
    if 1 not in by_c or target_c not in by_c or not by_c[1]:
        return None
    gain = by_c[target_c] / by_c[1]
    verdict = "met" if gain >= target_gain else "NOT met"
    return f"C={target_c} / C=1 aggregate: {gain:.2f}x (target >= {target_gain:.0f}x: {verdict})"


def write_json(
    path: Path,
    meta: Mapping[str, Any],
    ours: Sequence[LevelResult],
    peers: Mapping[str, Sequence[LevelResult]],
) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "meta": dict(meta),
        "table": comparison_rows(ours, peers),
        "ours": [level.to_dict() for level in ours],
        "peers": {name: [level.to_dict() for level in levels] for name, levels in peers.items()},
    }
    path.write_text(json.dumps(document, indent=2) + "\n")


def write_plot(
    path: Path, ours: Sequence[LevelResult], peers: Mapping[str, Sequence[LevelResult]]
) -> bool:
    """Throughput and latency vs concurrency; False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (throughput_ax, latency_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    levels = [level.concurrency for level in ours]
    throughput_ax.plot(levels, [lv.tokens_per_second for lv in ours], "o-", label="mlxserve")
    for name, results in peers.items():
        throughput_ax.plot(
            [lv.concurrency for lv in results],
            [lv.tokens_per_second for lv in results],
            "s--",
            label=name,
        )
    throughput_ax.set(
        xlabel="concurrent requests", ylabel="generated tokens/s (aggregate)", title="Throughput"
    )
    throughput_ax.set_ylim(bottom=0)
    summaries = [level.summary() for level in ours]
    for key, style in (
        ("ttft_p50", "o-"),
        ("ttft_p95", "o:"),
        ("itl_p50", "s-"),
        ("itl_p95", "s:"),
    ):
        values = [s[key] * 1000 if s[key] is not None else float("nan") for s in summaries]
        latency_ax.plot(levels, values, style, label=key.replace("_", " "))
    latency_ax.set(xlabel="concurrent requests", ylabel="ms", title="mlxserve latency")
    latency_ax.set_yscale("log")
    for ax in (throughput_ax, latency_ax):
        ax.set_xticks(levels)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
