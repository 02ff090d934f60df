"""Print the table rows and targets of `client bench` JSON files, one line per level:
python bench/print_table.py FILE.json [...]"""

import json
import sys
from pathlib import Path

for name in sys.argv[1:]:
    data = json.loads(Path(name).read_text())
    ours = {s["summary"]["concurrency"]: s["summary"] for s in data["ours"]}
    for row in data["table"]:
        c = row["concurrency"]
        cells = [f"{Path(name).stem} C={c}", f"ours {row['ours_tokens_per_second']:.1f}"]
        for peer in ("raw", "mlx-lm"):
            if f"{peer}_tokens_per_second" in row:
                cells.append(f"{peer} {row[f'{peer}_tokens_per_second']:.1f}")
                cells.append(f"ours/{peer} {row[f'ours_over_{peer}']:.2f}")
        server = ours.get(c, {}).get("server_ttft_p50")
        ttft = f"ttft {row['ttft_p50'] * 1e3:.1f}"
        cells.append(ttft + (f"/{server * 1e3:.1f} (server)" if server else ""))
        cells.append(f"itl {row['itl_p50'] * 1e3:.2f} ms")
        print("  ".join(cells))
    for target in data.get("targets", []):
        print("  ", target)
