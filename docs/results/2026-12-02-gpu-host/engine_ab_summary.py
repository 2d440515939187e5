"""Summarise engine_ab.sh's output: per codec, tree and part, the median over rounds of each run's best and
median us per batch. Usage: python engine_ab_summary.py engine-ab.txt"""

import re
import statistics
import sys
from collections import defaultdict

runs = defaultdict(list)  # (codec, tree, part) -> [(best, median)]
head = None
for line in open(sys.argv[1]):
    m = re.match(r"== (\S+) round \d+ (\S+)", line)
    if m:
        head = m.groups()
        continue
    m = re.match(r"\s+(\w+)\s+([\d.]+) /\s+([\d.]+)", line)
    if m and head:
        runs[head + (m.group(1),)].append((float(m.group(2)), float(m.group(3))))
print("| codec | part | base: best / median us per batch | new: best / median | new / base (best) |")
print("| --- | --- | --- | --- | ---: |")
for codec in dict.fromkeys(k[0] for k in runs):
    for part in dict.fromkeys(k[2] for k in runs if k[0] == codec):
        b, n = runs[(codec, "base", part)], runs[(codec, "new", part)]
        bb, bm = statistics.median(x for x, _ in b), statistics.median(y for _, y in b)
        nb, nm = statistics.median(x for x, _ in n), statistics.median(y for _, y in n)
        print(f"| {codec} | {part} | {bb:.1f} / {bm:.1f} | {nb:.1f} / {nm:.1f} | {nb / bb:.2f} |")
