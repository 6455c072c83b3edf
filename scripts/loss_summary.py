"""Print first -> last values of logged metrics of a run: python scripts/loss_summary.py <run_dir> <key>..."""

import csv
import sys
from pathlib import Path


def main() -> None:
    run_dir, keys = Path(sys.argv[1]), sys.argv[2:]
    rows = list(csv.DictReader((run_dir / "csv" / "metrics.csv").open()))
    for key in keys:
        values = [float(r[key]) for r in rows if r.get(key)]
        if not values:
            raise SystemExit(f"{key}: not logged in {run_dir}")
        head, tail = values[: max(1, len(values) // 10)], values[-max(1, len(values) // 10) :]
        a, b = sum(head) / len(head), sum(tail) / len(tail)
        print(f"{key}: {a:.4f} (first {len(head)} steps) -> {b:.4f} (last {len(tail)} steps) over {len(values)} steps")


if __name__ == "__main__":
    main()
