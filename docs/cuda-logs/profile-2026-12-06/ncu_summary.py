#!/usr/bin/env python3
"""Sums an ncu --csv log of gpu__time_duration.sum by kernel name: count, total and share."""
import csv, sys, collections, io

def main(path):
    text = open(path, encoding="utf-8", errors="replace").read()
    start = text.find('"ID"')
    rows = csv.DictReader(io.StringIO(text[start:]))
    scale = {"nsecond": 1e-6, "ns": 1e-6, "usecond": 1e-3, "us": 1e-3, "msecond": 1.0, "ms": 1.0, "second": 1e3, "s": 1e3}
    total = collections.Counter()
    count = collections.Counter()
    for r in rows:
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        name = r["Kernel Name"].split("(")[0]
        value = float(r["Metric Value"].replace(",", ""))
        total[name] += value * scale.get(r["Metric Unit"], 1.0)
        count[name] += 1
    all_ms = sum(total.values())
    print(f"{sum(count.values())} kernels, {all_ms:.1f} ms of GPU time")
    print(f"{'kernel':60} {'count':>7} {'ms':>9} {'share':>6} {'us each':>8}")
    for name, ms in total.most_common():
        print(f"{name[:60]:60} {count[name]:7} {ms:9.2f} {100*ms/all_ms:5.1f}% {1000*ms/count[name]:8.1f}")

if __name__ == "__main__":
    main(sys.argv[1])
