"""Where the host time of call1.sh's py-spy raw stacks goes (steady state: compile and import frames left out):
per codec and request kind, the samples under SavePipeline.save / RestorePipeline.restore by their leaf line
(self time: a CUDA call shows as the Python line that makes it) and by function (inclusive), waits
(Worker.finish, fetch, sync) apart. Usage: spy_leaves.py SPY_DIR CODECS..."""
import collections
import re
import sys

BAD = ("_compile_for_args", "importlib", "GpuCodecEngine.__init__", "crc_tables", "compile_using_nvrtc", "_gpu_present")
WAITS = ("synchronize",)


def agg(path: str, root: str):
    leaf, incl = collections.Counter(), collections.Counter()
    total = waits = 0
    for line in open(path):
        line = line.rstrip("\n")
        if not line:
            continue
        stack, n = line.rsplit(" ", 1)
        n = int(n)
        frames = stack.split(";")
        names = [re.sub(r" \(.*", "", f) for f in frames]
        if root not in names or any(b in stack for b in BAD):
            continue
        i = max(k for k, f in enumerate(names) if f == root)
        if any(w in frames[-1] for w in WAITS) or names[-1] == "Worker.finish":
            waits += n
            continue
        total += n
        leaf[re.sub(r"^.*?\((?:.*/)?([^/]*:\d+)\)$", r"\1", frames[-1]) + "  " + names[-1] + "  <- " +
             (names[-2] if len(names) > 1 else "")] += n
        for f in set(names[i:]):
            incl[f] += n
    return total, waits, leaf, incl


for codec in sys.argv[2:]:
    for root in ("SavePipeline.save", "RestorePipeline.restore"):
        total, waits, leaf, incl = agg(f"{sys.argv[1]}/{codec}-512.txt", root)
        print(f"\n{codec} {root}: {total} samples of host work, {waits} waiting (synchronize)")
        print("  by function, inclusive:")
        for f, n in incl.most_common(26)[1:]:
            print(f"  {n:5d} {100 * n / total:5.1f}%  {f}")
        print("  by leaf line:")
        for f, n in leaf.most_common(25):
            print(f"  {n:5d} {100 * n / total:5.1f}%  {f}")
