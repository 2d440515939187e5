"""Host-work breakdown of profile.sh's py-spy raw stacks (steady state: compile and import frames left out):
per codec, the samples under SavePipeline.save and RestorePipeline.restore, inclusive per function, with the
samples whose leaf is Worker.finish (a CUDA wait, spinning) counted apart. Usage: spy_report.py SPY_DIR CODECS..."""
import sys, re, collections
def agg(path, root, excl="Worker.finish"):
    incl = collections.Counter(); total = 0; waits = 0
    bad = ("_compile_for_args", "importlib", "GpuCodecEngine.__init__", "crc_tables", "compile_using_nvrtc", "_gpu_present")
    for line in open(path):
        line = line.rstrip("\n")
        if not line: continue
        stack, n = line.rsplit(" ", 1); n = int(n)
        frames = [re.sub(r" \(.*", "", f) for f in stack.split(";")]
        if not any(f == root for f in frames) or any(b in stack for b in bad): continue
        i = max(k for k, f in enumerate(frames) if f == root)
        fr = frames[i:]
        if excl in fr[-1]: waits += n; continue
        total += n
        for f in set(fr): incl[f] += n
    return total, waits, incl
for codec in sys.argv[2:]:
    p = f"{sys.argv[1]}/{codec}-512.txt"
    for root in ("SavePipeline.save", "RestorePipeline.restore"):
        total, waits, incl = agg(p, root)
        print(f"\n{codec} {root}: {total} samples of host work, {waits} in Worker.finish (waits)")
        for f, n in incl.most_common(22)[1:]:
            print(f"  {n:5d} {100*n/total:5.1f}%  {f}")
