"""Summarise call3's paired rounds: ``python summarize.py ab3`` prints, per codec, segment size and direction,
the median over the 8 neighbouring (prev, new) pairs of new / prev, the range of those ratios, and each
code's median GB/s and median ratio to ``none`` of the same round. Then each code's best over its 8 rounds
(the device's drift only ever slows a figure down, so the best of many rounds estimates what the code does
on a quiet host), with the ratios of those bests to ``none``'s best and to the pinned copy measured in the
same round as the best figure."""
import pathlib
import re
import statistics
import sys

LINE = re.compile(r"^\s*(\S+)\s+(\d+) KiB\s+save ([\d.]+) GB/s\s+restore ([\d.]+) GB/s")


def rounds(folder: pathlib.Path) -> list[tuple[str, dict]]:
    out = []
    for log in sorted(folder.glob("r*.log")):
        figs = {}
        for line in log.read_text().splitlines():
            m = LINE.match(line)
            if m:
                codec, kib, save, restore = m.groups()
                figs[(codec, int(kib), "save")] = float(save)
                figs[(codec, int(kib), "restore")] = float(restore)
            b = re.search(r"\(baseline ([\d.]+) / ([\d.]+)\)", line)
            if m and b:
                figs[("copy", int(kib), "save")] = float(b.group(1))
                figs[("copy", int(kib), "restore")] = float(b.group(2))
        out.append((log.stem.split("-")[1], figs))
    return out


def main() -> None:
    rs = rounds(pathlib.Path(sys.argv[1]))
    pairs = [(rs[i], rs[i + 1]) for i in range(0, len(rs) - 1, 2)]  # (prev, new) or (new, prev) neighbours
    keys = sorted((k for k in rs[0][1] if k[0] != "copy"), key=lambda k: (k[1], ["none", "fp8", "turboquant-4"].index(k[0]), k[2]))
    print(f"{len(rs)} rounds, {len(pairs)} pairs")
    print("| codec | segment | direction | new / prev, median of pairs (range) | prev GB/s median | new GB/s median "
          "| prev x none median | new x none median |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for k in keys:
        ratios = []
        for a, b in pairs:
            new, prev = (a, b) if a[0] == "new" else (b, a)
            ratios.append(new[1][k] / prev[1][k])
        by = {c: [f[k] for code, f in rs if code == c] for c in ("prev", "new")}
        xnone = {c: [f[k] / f[("none", k[1], k[2])] for code, f in rs if code == c] for c in ("prev", "new")}
        print(f"| {k[0]} | {k[1]} KiB | {k[2]} | {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) "
              f"| {statistics.median(by['prev']):.1f} | {statistics.median(by['new']):.1f} "
              f"| {statistics.median(xnone['prev']):.2f} | {statistics.median(xnone['new']):.2f} |")
    print()
    print("| codec | segment | direction | prev best GB/s | new best GB/s | new / prev | prev best x none best "
          "| new best x none best | new best / copy |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for k in keys:
        best = {c: max(f[k] for code, f in rs if code == c) for c in ("prev", "new")}
        none = {c: max(f[("none", k[1], k[2])] for code, f in rs if code == c) for c in ("prev", "new")}
        at = max((f for code, f in rs if code == "new"), key=lambda f: f[k])  # the round of the new best
        copy = at[("copy", k[1], k[2])]
        print(f"| {k[0]} | {k[1]} KiB | {k[2]} | {best['prev']:.1f} | {best['new']:.1f} | {best['new'] / best['prev']:.2f} "
              f"| {best['prev'] / none['prev']:.2f} | {best['new'] / none['new']:.2f} | {best['new'] / copy:.2f} |")


if __name__ == "__main__":
    main()
