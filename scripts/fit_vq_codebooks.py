"""Fit the vq codebooks (seeded k-means on N(0, I), :func:`kvtier.codecs.vq.fit_codebook`) and write
``src/kvtier/data/vq_codebooks.bin``; prints the sha256 to pin in ``kvtier.codecs.vq.CODEBOOK_SHA256``.

    python scripts/fit_vq_codebooks.py [--out PATH]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvtier.codecs.vq import CODEBOOK_SHA256, write_codebooks

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="write here instead of the package's file")
    args = ap.parse_args()
    digest = write_codebooks(args.out)
    print(f"sha256 {digest} ({'the pinned one' if digest == CODEBOOK_SHA256 else 'differs from the pinned one'})")
