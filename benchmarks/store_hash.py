"""What the data store's content key costs per start: rolemrc.data.store.content_hash (xxh3-128 of
every byte, streamed) against sha256 over the same file, from the page cache (docs/training.md).

    python benchmarks/store_hash.py            # a 1 GiB file of random bytes in a temp folder
    python benchmarks/store_hash.py --gib 4    # how the cost grows (linear in the bytes read)
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
import time
from pathlib import Path

from rolemrc.data.store import HASH_CHUNK, content_hash


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0, help="file size in GiB (default 1)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="rolemrc-hash-") as tmp:
        path = Path(tmp) / "data.bin"
        block = os.urandom(64 * 1024**2)
        with path.open("wb") as f:
            for _ in range(max(1, round(args.gib * 16))):
                f.write(block)
        size = path.stat().st_size
        _sha256(path)  # read once: both timed from the page cache
        for name, fn in (("xxh3-128 (content_hash)", content_hash), ("sha256", _sha256)):
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                fn(path)
                times.append(time.perf_counter() - t0)
            print(f"{name}: {size / 1024**3:.2f} GiB in {min(times):.2f}-{max(times):.2f} s "
                  f"({size / 1024**3 / min(times):.2f} GiB/s best of {args.repeats})")


if __name__ == "__main__":
    main()
