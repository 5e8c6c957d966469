#!/usr/bin/env python3
"""Where a suite's steps spent their time: the median of every perf/* column of scalars.parquet
over all steps of all runs of SUITE in STORE, one line each (seconds shown as ms).
Usage: perf-breakdown.py STORE SUITE. Needs pyarrow (the GPU image has it).
"""
import pathlib, statistics, sys
import pyarrow.parquet as pq

store, suite = pathlib.Path(sys.argv[1]), sys.argv[2]
cols = {}
for m in sorted((store / suite).glob("*/manifest.json")):
    t = pq.read_table(m.parent / "scalars.parquet").to_pydict()
    for k, v in t.items():
        if k.startswith("perf/"):
            cols.setdefault(k, []).extend(x for x in v if x is not None)
for k in sorted(cols):
    v = cols[k]
    med = statistics.median(v) if v else float("nan")
    shown = f"{med * 1e3:10.2f} ms" if k.endswith("_time") else f"{med:12.1f}"
    print(f"{k:40s} {shown}  ({len(v)} values)")
