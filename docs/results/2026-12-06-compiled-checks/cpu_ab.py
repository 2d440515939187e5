"""cpu-ab.sh's output summed up: per job, each variant's median wall per request (and per segment, 2,304 a request)
and the median and range of new / base over the pairs (each new run against the base run after it).
Usage: cpu_ab.py cpu-ab.txt"""
import re
import statistics
import sys

runs: dict = {}
for line in open(sys.argv[1]):
    m = re.match(r"(\w+) (\S+) (\w+): .*median wall (\d+) us", line)
    if m:
        runs.setdefault(f"{m[1]} {m[2]}", {}).setdefault(m[3], []).append(int(m[4]))
print("| job | new: median us a request (us/seg) | base | new / base, median of pairs (range) |")
print("| --- | --- | --- | --- |")
for job, v in runs.items():
    new, base = v["new"], v["base"]
    ratio = [a / b for a, b in zip(new, base)]
    mn, mb = statistics.median(new), statistics.median(base)
    print(f"| {job} | {mn:.0f} ({mn / 2304:.2f}) | {mb:.0f} ({mb / 2304:.2f}) | "
          f"{statistics.median(ratio):.2f} ({min(ratio):.2f}-{max(ratio):.2f}) |")
