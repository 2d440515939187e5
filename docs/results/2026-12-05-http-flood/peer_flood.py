"""A local process holds connections to a Manager's peer port (peer sharing on, a secret set): 3,000 TCP
connections that complete the ZMTP handshake (greeting and READY, as a DEALER sends them; no frame, so no secret
needed) and then say nothing. The Manager's descriptors, ``/healthz`` and an engine's save while they are held,
and its descriptors 35 s later. Same Manager setup as flood.py (PYTHONPATH=PKG).

Usage: PYTHONPATH=PKG python peer_flood.py N OUT.json"""
import json, os, resource, shutil, socket, subprocess, sys, time, urllib.request, tempfile
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
work = tempfile.mkdtemp(dir="/dev/shm", prefix="pf-")
def fp():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p
http, peer, dp = fp(), fp(), f"tcp://127.0.0.1:{fp()}"
secret = os.path.join(work, "secret"); open(secret, "w").write("x" * 32); os.chmod(secret, 0o600)
log = open(os.path.join(work, "m.log"), "w")
m = subprocess.Popen([sys.executable, "-m", "orbitkv_fs.server.cli", "--pool-size", "64mb",
                      "--http-addr", f"127.0.0.1:{http}", "--data-plane", dp, "--peer-port", str(peer),
                      "--peer-secret-file", secret, "--shm-dir", work,
                      "--log-level", "warning"], stderr=log, cwd=work,
                     preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard)))
def get(p, t=3):
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{http}{p}", timeout=t).status
    except Exception as e:
        return type(e).__name__
for _ in range(150):
    if get("/healthz", 0.5) == 200: break
    time.sleep(0.2)
limits = [ln for ln in open(f"/proc/{m.pid}/limits") if "open files" in ln][0]
out = {"pkg": os.environ.get("PYTHONPATH"), "connections": int(sys.argv[1]),
       "manager_descriptor_limit": int(limits.split()[3])}
socks = []
for _ in range(int(sys.argv[1])):
    s = socket.socket(); s.settimeout(2)
    try:
        s.connect(("127.0.0.1", peer))
        # a ZMTP 3.0 greeting, NULL mechanism, as a DEALER would send it; then a READY command
        body = b"\x05READY" + b"\x0bSocket-Type" + (6).to_bytes(4, "big") + b"DEALER"
        s.sendall(b"\xff" + b"\0" * 8 + b"\x7f\x03\x00NULL" + b"\0" * 16 + b"\0" + b"\0" * 31
                  + b"\x04" + bytes([len(body)]) + body)
        socks.append(s)
    except OSError:
        s.close(); break
time.sleep(2)
out["held"] = {"opened": len(socks), "descriptors": len(os.listdir(f"/proc/{m.pid}/fd")), "healthz": get("/healthz")}
r = subprocess.run([sys.executable, "-m", "orbitkv_fs.tools.sample_engine", "save", "--codec", "none",
                    "--data-plane", dp, "--shm-dir", work], capture_output=True, text=True, timeout=60, cwd=work)
said = ((r.stdout + r.stderr).strip().splitlines() or [""])[-1][:200]
out["held"]["engine_save"] = {"rc": r.returncode, "said": said}
time.sleep(35)
out["after_35s"] = {"descriptors": len(os.listdir(f"/proc/{m.pid}/fd")), "healthz": get("/healthz")}
for s in socks: s.close()
m.terminate(); m.wait(30); log.close()
out["manager_log_lines"] = sum(1 for _ in open(os.path.join(work, "m.log")))
shutil.rmtree(work)  # the arena, the sample engine's pages, the secret and the log
json.dump(out, open(sys.argv[2], "w"), indent=1)
print(json.dumps(out))
