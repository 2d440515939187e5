"""The README's tables from the rounds' JSON: python summarize.py > rounds.md (run in this folder)."""
import json
import os

CALLS = [("ab/call1", "new1 old1 new2 old2", "codecs one after another"),
         ("ab/call2", "new1 old1 new2 old2 new3 old3", "codecs one after another"),
         ("ab/call3", "new1 old1 new2 old2 new3 old3", "codecs round robin"),
         ("final", "new4 old4 new5 old5", "codecs round robin, final code"),
         ("final", "ansnew1 ansold1 ansnew2 ansold2", "none and ans round robin, final code"),
         ("rows", "rows1 prev1 rows2 prev2", "codecs round robin, descriptor rows packed in place against b69424b")]


def load(path: str) -> dict:
    with open(os.path.join(path, "pipeline-gpu.json")) as f:
        j = json.load(f)
    return {(r["codec"], r["segment_bytes"] >> 10): r for r in j["throughput"]["runs"]}, j["code"]["source_sha256"][:12]


def cell(r: dict) -> str:
    s = f"{r['save_gbs']:.1f} / {r['restore_gbs']:.1f}"
    if r["codec"] == "none":
        return s + f" ({r['save_vs_baseline']:.2f} / {r['restore_vs_baseline']:.2f} of copy)"
    return s + f" ({r['save_vs_none']:.2f} / {r['restore_vs_none']:.2f}x none)"


for folder, rounds, what in CALLS:
    rounds = rounds.split()
    data = {r: load(os.path.join(folder, r)) for r in rounds}
    print(f"### {folder}: {what}\n")
    print("| codec, segment | " + " | ".join(f"{r} (`{data[r][1]}`)" for r in rounds) + " |")
    print("| --- | " + " | ".join("---" for _ in rounds) + " |")
    for key in data[rounds[0]][0]:
        print(f"| {key[0]}, {key[1]} KiB | " + " | ".join(cell(data[r][0][key]) for r in rounds) + " |")
    print()
