#!/usr/bin/env python3
"""Whether the runs of one suite in two stores hold the same metrics, bit for bit: every column
of scalars.parquet except the wall-clock perf/* ones, all of layers.parquet and events.jsonl.
Usage: same-metrics.py STORE_A STORE_B SUITE. Prints one line per differing run and a count;
exits 1 on any difference or run missing from either store. Needs pyarrow (the GPU image has it).
"""
import json, pathlib, sys
import pyarrow.parquet as pq

a, b, suite = (pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3])

def runs(store):
    return {p.parent.name: p.parent for p in (store / suite).glob("*/manifest.json")}

def table(run, name, drop_perf=False):
    t = pq.read_table(run / name).to_pydict()
    return {k: v for k, v in t.items() if not (drop_perf and k.startswith("perf/"))}

ra, rb = runs(a), runs(b)
bad = sorted(set(ra) ^ set(rb))
for r in bad:
    print(f"{r}: in one store only")
same = 0
for r in sorted(set(ra) & set(rb)):
    x, y = ra[r], rb[r]
    diffs = []
    if table(x, "scalars.parquet", True) != table(y, "scalars.parquet", True):
        diffs.append("scalars")
    if table(x, "layers.parquet") != table(y, "layers.parquet"):
        diffs.append("layers")
    if (x / "events.jsonl").read_bytes() != (y / "events.jsonl").read_bytes():
        diffs.append("events")
    da = json.loads((x / "manifest.json").read_text())
    db = json.loads((y / "manifest.json").read_text())
    if da["status"] != db["status"]:
        diffs.append(f"status {da['status']} vs {db['status']}")
    if diffs:
        bad.append(r)
        print(f"{r}: differs in {', '.join(diffs)} ({da['device']} vs {db['device']})")
    else:
        same += 1
print(f"{same} runs identical, {len(bad)} differ or missing ({a} vs {b})")
sys.exit(1 if bad else 0)
