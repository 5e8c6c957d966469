#!/usr/bin/env python3
"""Where a sweep's step time goes: the mean of every perf/* column of every run's
scalars.parquet in STORE/SUITE, in ms per step (rates as they are), and the steps counted.
Usage: phase-times.py STORE SUITE. Needs pyarrow (the GPU image has it)."""
import collections, pathlib, sys
import pyarrow.parquet as pq

root = pathlib.Path(sys.argv[1]) / sys.argv[2]
sums, counts = collections.defaultdict(float), collections.Counter()
for f in root.glob("*/scalars.parquet"):
    for k, col in pq.read_table(f).to_pydict().items():
        if k.startswith("perf/"):
            for v in col:
                if v is not None:
                    sums[k] += v
                    counts[k] += 1
for k in sorted(sums):
    mean = sums[k] / counts[k]
    shown = f"{mean:10.1f}/s" if k.endswith("_per_s") else f"{mean * 1e3:10.2f} ms"
    print(f"{k:32} {shown}  ({counts[k]} steps)")
