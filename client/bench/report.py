"""The benchmark report: side-by-side tables, a JSON file and a PNG plot."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from client.bench.metrics import PERCENTILES, LevelResult


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    ms = seconds * 1000
    return f"{ms:.1f}" if ms < 100 else f"{ms:.0f}"


def _level_name(level: LevelResult) -> str:
    return str(level.concurrency) if level.rate is None else f"{level.rate:g}/s"


def _match(levels: Sequence[LevelResult], like: LevelResult) -> LevelResult | None:
    return next(
        (p for p in levels if p.concurrency == like.concurrency and p.rate == like.rate), None
    )


def comparison_rows(
    ours: Sequence[LevelResult], peers: Mapping[str, Sequence[LevelResult]]
) -> list[dict[str, Any]]:
    """One row per level: our figures, each peer's tok/s and our ratio to it."""
    base = min(ours, key=lambda level: level.x, default=None)
    rows = []
    for level in ours:
        summary = level.summary()
        row: dict[str, Any] = {
            "level": _level_name(level),
            "concurrency": level.concurrency,
            "rate": level.rate,
            "ours_tokens_per_second": level.tokens_per_second,
            "ours_requests_per_second": summary["requests_per_second"],
            "ours_errors": summary["errors"],
            "ours_completion_tokens": summary["completion_tokens"],
            **{k: summary[k] for k in summary if k.startswith(("ttft_p", "itl_p"))},
            "scaling_vs_lowest": (
                level.tokens_per_second / base.tokens_per_second
                if base and base.tokens_per_second and level.rate is None
                else None
            ),
        }
        for name, results in peers.items():
            peer = _match(results, level)
            peer_rate = peer.tokens_per_second if peer else None
            row[f"{name}_tokens_per_second"] = peer_rate
            row[f"ours_over_{name}"] = level.tokens_per_second / peer_rate if peer_rate else None
        rows.append(row)
    return rows


def _table(header: list[str], lines: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *lines]) for i in range(len(header))]
    out = ["  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True))]
    out += ["  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)) for cells in lines]
    return out


def format_table(rows: Sequence[Mapping[str, Any]], peer_names: Sequence[str]) -> str:
    header = ["C/rate", "ours tok/s", "req/s", "err"]
    header += [f"TTFT p{p}" for p in PERCENTILES] + [f"ITL p{p}" for p in PERCENTILES]
    for name in peer_names:
        header += [f"{name} tok/s", f"ours/{name}"]
    header.append("scaling")
    lines = []
    for row in rows:
        cells = [
            row["level"],
            f"{row['ours_tokens_per_second']:.1f}",
            f"{row['ours_requests_per_second']:.2f}",
            str(row["ours_errors"]),
        ]
        cells += [_ms(row[f"ttft_p{p}"]) for p in PERCENTILES]
        cells += [_ms(row[f"itl_p{p}"]) for p in PERCENTILES]
        for name in peer_names:
            rate, ratio = row[f"{name}_tokens_per_second"], row[f"ours_over_{name}"]
            cells += [
                "-" if rate is None else f"{rate:.1f}",
                "-" if ratio is None else f"{ratio:.2f}x",
            ]
        scaling = row["scaling_vs_lowest"]
        cells.append("-" if scaling is None else f"{scaling:.2f}x")
        lines.append(cells)
    out = _table(header, lines)
    out.append("(latencies in ms; scaling = ours tok/s over ours at the lowest C)")
    return "\n".join(out)


def format_target_table(name: str, levels: Sequence[LevelResult]) -> str:
    """One target's own figures: throughput and latency percentiles per level."""
    header = ["C/rate", "tok/s", "req/s", "err", "tokens"]
    header += [f"TTFT p{p}" for p in PERCENTILES] + [f"ITL p{p}" for p in PERCENTILES]
    lines = []
    for level in levels:
        s = level.summary()
        cells = [
            _level_name(level),
            f"{level.tokens_per_second:.1f}",
            f"{s['requests_per_second']:.2f}",
            str(s["errors"]),
            str(s["completion_tokens"]),
        ]
        cells += [_ms(s[f"ttft_p{p}"]) for p in PERCENTILES]
        cells += [_ms(s[f"itl_p{p}"]) for p in PERCENTILES]
        lines.append(cells)
    return "\n".join([f"{name}:", *_table(header, lines)])


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
    path.write_text(json.dumps(document, indent=1) + "\n")


def write_plot(
    path: Path,
    ours: Sequence[LevelResult],
    peers: Mapping[str, Sequence[LevelResult]],
    title: str = "",
) -> bool:
    """Throughput, TTFT and ITL vs concurrency (or rate); False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    targets = {"mlxserve": list(ours), **{k: list(v) for k, v in peers.items()}}
    fig, (tp_ax, ttft_ax, itl_ax) = plt.subplots(1, 3, figsize=(15, 4.4))
    open_loop = any(lv.rate is not None for lv in ours)
    xlabel = "offered load (requests/s)" if open_loop else "concurrent requests (C)"
    markers = "osd^v<>"
    for index, (name, levels) in enumerate(targets.items()):
        if not levels:
            continue
        color = f"C{index}"
        xs = [lv.x for lv in levels]
        summaries = [lv.summary() for lv in levels]
        marker = markers[index % len(markers)]
        tp_ax.plot(
            xs, [lv.tokens_per_second for lv in levels], f"{marker}-", color=color, label=name
        )
        for ax, key in ((ttft_ax, "ttft"), (itl_ax, "itl")):
            for pct, style in ((50, "-"), (95, ":")):
                values = [
                    s[f"{key}_p{pct}"] * 1000 if s[f"{key}_p{pct}"] is not None else float("nan")
                    for s in summaries
                ]
                ax.plot(xs, values, f"{marker}{style}", color=color, label=f"{name} p{pct}")
    tp_ax.set(xlabel=xlabel, ylabel="generated tokens/s (aggregate)", title="Throughput")
    tp_ax.set_ylim(bottom=0)
    ttft_ax.set(xlabel=xlabel, ylabel="ms", title="Time to first token")
    itl_ax.set(xlabel=xlabel, ylabel="ms", title="Inter-token latency")
    xs_all = sorted({lv.x for lv in ours})
    for ax in (tp_ax, ttft_ax, itl_ax):
        if not open_loop and len(xs_all) > 1:
            ax.set_xscale("log", base=2)
        ax.set_xticks(xs_all)
        ax.set_xticklabels([f"{x:g}" for x in xs_all])
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for ax in (ttft_ax, itl_ax):
        ax.set_yscale("log")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def levels_from_document(items: Sequence[Mapping[str, Any]]) -> list[LevelResult]:
    """LevelResults back from a written JSON file's `ours` or `peers[name]` list."""
    from client.bench.metrics import RequestRecord

    levels = []
    for item in items:
        summary = item["summary"]
        level = LevelResult(
            target=summary["target"],
            concurrency=summary["concurrency"],
            rate=summary.get("rate"),
            wall_seconds=summary["wall_seconds"],
            requests=[RequestRecord(**r) for r in item["requests"]],
        )
        if not item["requests"]:  # a totals-only peer (mlx-lm-batch)
            level.completion_tokens_total = summary["completion_tokens"]
            level.request_count = summary["requests"]
        levels.append(level)
    return levels


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m client.bench.report FILE.json`: the tables of a finished run again."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("path", type=Path)
    parser.add_argument("--plot", type=Path, help="also (re)draw the PNG here")
    args = parser.parse_args(argv)
    document = json.loads(args.path.read_text())
    ours = levels_from_document(document["ours"])
    peers = {name: levels_from_document(v) for name, v in document["peers"].items()}
    print(format_table(comparison_rows(ours, peers), list(peers)))
    for name, levels in peers.items():
        if any(level.requests for level in levels):
            print(format_target_table(name, levels))
    if args.plot:
        write_plot(args.plot, ours, peers, str(args.path.name))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
