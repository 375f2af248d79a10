"""What the first save of a process costs against warm ones (issue 22): a diagnosis.

One Checkpointer with a fast tier, ``prepare(wait=True)``, then 5 saves, each charged step by
step against 12 plain steps timed before it; the first two sampled (Python stacks of every
thread, every 2 ms) and every save's CPU time split by thread:

  PYTHONPATH=src python3 experiments/first_save.py llama      (SIZE=tiny DEVICE=cpu: a CPU check)

Writes ``$OUT/first.json`` (or /tmp); prints the stats that differ between saves 0 and 1.
"""
import json, os, shutil, statistics, sys, time
import torch
import gpusnap
from gpusnap.bench.workloads import build_workload

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from promotion_cost import step_time  # (a step timed to its loss, as there)

def window(ck, wl, n=12):
    plain = [step_time(wl) for _ in range(n)]; med = statistics.median(plain)
    cpu0 = time.process_time(); t0 = time.perf_counter()
    p = ck.save(wl.app_state); ret = time.perf_counter() - t0
    times = [step_time(wl)]
    while not p.done(): times.append(step_time(wl))
    for _ in range(3): times.append(step_time(wl))
    info = p.wait()
    return {"cost_ms": round(sum(t - med for t in times) * 1e3, 1), "save_ret_ms": round(ret * 1e3, 1),
            "excess_ms": [round((t - med) * 1e3, 1) for t in times[:12]], "steps": len(times), "step_ms": round(med * 1e3, 1),
            "cpu_s": round(time.process_time() - cpu0 - len(times) * med, 2),
            "stats": {k: (round(v, 4) if isinstance(v, float) else v) for k, v in info.stats.items()
                      if isinstance(v, (int, float, bool, str))},
            "phases": {k: v for k, v in info.stats.items() if isinstance(v, dict)}}

import collections, threading, traceback
def task_cpu():
    out = collections.Counter(); tick = os.sysconf("SC_CLK_TCK")
    py = {str(t.native_id): t.name for t in threading.enumerate()}
    for tid in os.listdir("/proc/self/task"):
        try:
            comm = py.get(tid) or "native:" + open(f"/proc/self/task/{tid}/comm").read().strip()
            comm = comm.rstrip("0123456789_")
            f = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
            out[comm] += (int(f[11]) + int(f[12])) / tick
        except OSError: pass
    return out
class Sampler:
    def __init__(self):
        self.own = collections.Counter(); self.cum = collections.Counter(); self.stop = False; self.n = 0
        self.t = threading.Thread(target=self.run, daemon=True); self.t.start()
    def run(self):
        me = threading.get_ident(); names = {}
        while not self.stop:
            for t in threading.enumerate(): names[t.ident] = t.name
            for ident, fr in sys._current_frames().items():
                if ident == me: continue
                st = traceback.extract_stack(fr)
                nm = names.get(ident, "?")
                if nm == "MainThread" and not any("gpusnap" in f.filename for f in st): continue
                if not st: continue
                top = st[-1]; self.own[(nm[:18], f"{os.path.basename(top.filename)}:{top.name}:{top.lineno}")] += 1
                for f in {(os.path.basename(f.filename), f.name) for f in st if "gpusnap" in f.filename}:
                    self.cum[(nm[:18],) + f] += 1
            self.n += 1; time.sleep(0.002)
    def done(self, label):
        self.stop = True; self.t.join()
        print(f"--- samples {label}: {self.n}")
        for k, v in self.own.most_common(18): print(f"  own {v:5d} {k}")
        for k, v in self.cum.most_common(18): print(f"  cum {v:5d} {k}")

root = "/dev/shm/gpusnap-first"; shutil.rmtree(root, ignore_errors=True)
wl = build_workload(sys.argv[1] if len(sys.argv) > 1 else "llama", torch.device(os.environ.get("DEVICE", "cuda")), size=os.environ.get("SIZE", "quick"))
for _ in range(5): step_time(wl)
ck = gpusnap.Checkpointer(os.path.join(root, "d"), keep_last=1, fast_root=os.path.join(root, "f"), fast_keep_last=2, promote_every=10**6)
t0 = time.perf_counter(); c0 = time.process_time(); ck.prepare(wl.app_state, wait=True)
print(f"prepare {time.perf_counter()-t0:.2f} s, {time.process_time()-c0:.2f} CPU-s", flush=True)
rows = []
for i in range(5):
    c0 = task_cpu(); smp = Sampler() if i < 2 else None
    rows.append(window(ck, wl))
    if smp: smp.done(f"save {i}")
    d = task_cpu(); d.subtract(c0)
    print(f"save {i} thread CPU-s:", {k: round(v, 2) for k, v in d.most_common(8) if v > 0.005}, flush=True)
ck.close(); shutil.rmtree(root, ignore_errors=True)
out = os.environ.get("OUT", "/tmp")
json.dump(rows, open(os.path.join(out, "first.json"), "w"), indent=1)
keys = sorted(set(rows[0]["stats"]) | set(rows[1]["stats"]))
for k in keys:
    vals = [r["stats"].get(k) for r in rows]
    if vals[0] != vals[1]: print(f"  {k:40s} " + "  ".join(str(v) for v in vals))
for i, r in enumerate(rows):
    for pk, pv in r["phases"].items():
        print(f"save {i} {pk} ms:", {k: round(v * 1e3, 1) for k, v in pv.items() if isinstance(v, (int, float)) and v >= 5e-4})
for i, r in enumerate(rows):
    print(f"save {i}: cost {r['cost_ms']} ms, ret {r['save_ret_ms']} ms, cpu {r['cpu_s']} s, steps {r['steps']}, excess {r['excess_ms']}")
