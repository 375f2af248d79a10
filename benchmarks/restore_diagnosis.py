"""Where does an eager restore's time go? (GPU diagnostic, not a benchmark)

GPT-2 large training state (model + AdamW moments, ~9.3 GB: the quick bench's workload),
saved once on tmpfs with device hashes, then restored in place under variants of the
restore's knobs. For each: GB/s against pinned H2D, the copy thread's busy share, the readers'
waits for host regions, and (``--sample``) a sampled profile of the copy thread: the frames it
was in, counted every ~0.5 ms through ``sys._current_frames`` (a poor man's py-spy; the copy
thread being busy all the time is what the quick bench showed).

Variants (comma list, ``--variants``): default, piece16/piece64/piece128 (16/64/128 MiB pieces),
p64r8/p64r12 (64 MiB pieces, 8/12 readers), nojoin (small spans keep BLAKE2b on the host
instead of joining device-checked batches), readers16/12/8/6/4,
slots8 (device scratch slots), big (piece64 + readers8 + slots8), host (BLAKE2b on the host),
off (no verification), switch (GIL switch interval 0.5 ms instead of 5 ms); threads (reader
threads read, no reader processes: the default before the twelfth session), t64r8 (that with
64 MiB pieces and 8 readers), procs6/8/14 (reader processes), p64procs12 (64 MiB pieces);
procs (32 MiB pieces: the default before the thirteenth session), direct (direct-copy helpers,
Config.restore_direct_copies="auto"), direct4/6/12 (that with 4/6/12 helpers), d32 (with
32 MiB pieces), dnoprocs (direct copies, no reader processes for the rest).
Run: PYTHONPATH=src python3 benchmarks/restore_diagnosis.py --sample
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import sys
import tempfile
import threading
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))
import restore_models as rb  # (the H2D ceiling and device sync)

import gpusnap
from gpusnap.restore import restorer as restorer_mod
from gpusnap.restore.pipeline import loader as loader_mod

MiB = 1 << 20
VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "piece16": {"config": {"restore_piece_bytes": 16 * MiB}},
    "piece64": {"config": {"restore_piece_bytes": 64 * MiB}},
    "piece128": {"config": {"restore_piece_bytes": 128 * MiB}},
    "p64r8": {"config": {"restore_piece_bytes": 64 * MiB}, "readers": 8},
    "p64r12": {"config": {"restore_piece_bytes": 64 * MiB}, "readers": 12},
    "nojoin": {"join": False},
    "readers16": {"readers": 16},
    "readers12": {"readers": 12},
    "readers8": {"readers": 8},
    "readers6": {"readers": 6},
    "readers4": {"readers": 4},
    "slots8": {"config": {"restore_scratch_slots": 8}},
    "big": {"config": {"restore_piece_bytes": 64 * MiB, "restore_scratch_slots": 8}, "readers": 8},
    "host": {"config": {"restore_verify_on_device": "off"}},
    "off": {"verify": "off"},
    "switch": {"switch": 5e-4},
    # reader threads reading for themselves (the path before reader processes): "threads" is
    # the old default; the reader-process variants set how many processes (PROC_READERS)
    "threads": {"config": {"restore_reader_processes": "off", "restore_direct_copies": "off"}},
    "t64r8": {"config": {"restore_reader_processes": "off", "restore_direct_copies": "off",
                         "restore_piece_bytes": 64 * MiB}, "readers": 8},
    "procs6": {"procs": 6, "config": {"restore_direct_copies": "off"}},
    "procs8": {"procs": 8, "config": {"restore_direct_copies": "off"}},
    "procs14": {"procs": 14, "config": {"restore_direct_copies": "off"}},
    "p64procs12": {"config": {"restore_piece_bytes": 64 * MiB, "restore_direct_copies": "off"}},
    # direct-copy helpers (restore/pipeline/sources/direct_copies.py)
    "procs": {"config": {"restore_piece_bytes": 32 * MiB}},
    "direct": {"config": {"restore_direct_copies": "auto"}},
    "direct4": {"direct": 4, "config": {"restore_direct_copies": "auto"}},
    "direct6": {"direct": 6, "config": {"restore_direct_copies": "auto"}},
    "direct12": {"direct": 12, "config": {"restore_direct_copies": "auto"}},
    "d32": {"config": {"restore_piece_bytes": 32 * MiB, "restore_direct_copies": "auto"}},
    "dnoprocs": {"config": {"restore_reader_processes": "off", "restore_direct_copies": "auto"}},
}


def build_state(dev: torch.device, tiny: bool) -> dict[str, Any]:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=2) if tiny else GPT2Config(n_layer=36, n_embd=1280, n_head=20)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg).to(dev)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, cfg.vocab_size, (2, 64), device=dev)
    model(ids, labels=ids).loss.backward()
    optim.step()
    return {"model": model, "optim": optim}


class Sampler:
    """Counts the innermost frames of one thread (by name) every ``period`` seconds."""

    def __init__(self, names: tuple[str, ...], period: float = 5e-4) -> None:
        self.names, self.period = names, period
        self.leaf: collections.Counter[str] = collections.Counter()
        self.ours: collections.Counter[str] = collections.Counter()
        self.samples: collections.Counter[str] = collections.Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:  # noqa: PYI034 (never subclassed)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            frames = sys._current_frames()
            for t in threading.enumerate():
                frame = frames.get(t.ident) if t.name in self.names else None
                if frame is None:
                    continue
                who = "copy" if t.name != "MainThread" else "main"
                self.samples[who] += 1
                code = frame.f_code
                self.leaf[f"{who}: {code.co_name} ({os.path.basename(code.co_filename)}:{frame.f_lineno})"] += 1
                while frame is not None and "gpusnap" not in frame.f_code.co_filename:
                    frame = frame.f_back
                if frame is not None:
                    self.ours[f"{who}: {frame.f_code.co_name} (:{frame.f_lineno})"] += 1

    def top(self, n: int = 14) -> list[str]:
        """The most sampled frames, as shares of each thread's samples."""

        def share(key: str, count: int) -> float:
            return 100 * count / max(1, self.samples[key.split(":")[0]])

        lines = [f"    samples: {dict(self.samples)}"]
        lines += [f"    leaf {share(k, c):5.1f}%  {k}" for k, c in self.leaf.most_common(n)]
        lines += [f"    ours {share(k, c):5.1f}%  {k}" for k, c in self.ours.most_common(n)]
        return lines


def run_variant(name: str, root: str, app: dict[str, Any], cid: str, dev: torch.device, sample: bool,
                repeat: int) -> dict[str, Any]:
    spec = VARIANTS[name]
    saved_threads, saved_switch = restorer_mod.reader_threads, sys.getswitchinterval()
    saved_cap, saved_join = loader_mod.DEVICE_CHECK_READERS, loader_mod.JOIN_CHECKS
    saved_procs, saved_direct = restorer_mod.PROC_READERS, restorer_mod.DIRECT_HELPERS
    restorer_mod.PROC_READERS = spec.get("procs", saved_procs)
    restorer_mod.DIRECT_HELPERS = spec.get("direct", saved_direct)
    loader_mod.JOIN_CHECKS = spec.get("join", saved_join)
    if "readers" in spec:
        restorer_mod.reader_threads = lambda io_threads, n=spec["readers"]: n
        loader_mod.DEVICE_CHECK_READERS = spec["readers"]
    sys.setswitchinterval(spec.get("switch", saved_switch))
    try:
        config = gpusnap.Config.from_env(fsync=False, **spec.get("config", {}))
        best: dict[str, Any] = {}
        free_before = torch.cuda.mem_get_info(dev)[0] if dev.type == "cuda" else 0
        with gpusnap.Checkpointer(root, config=config) as ck:
            for attempt in range(repeat + 1):  # the first grows the pinned regions: not counted
                sampler = Sampler(("gpusnap-restore-copy", "MainThread")) if sample and attempt == repeat else None
                rb.sync(dev)
                t0 = time.perf_counter()
                if sampler:
                    with sampler:
                        handle = ck.restore(app, cid, verify=spec.get("verify", "stream"))
                        rb.sync(dev)
                else:
                    handle = ck.restore(app, cid, verify=spec.get("verify", "stream"))
                    rb.sync(dev)
                secs = time.perf_counter() - t0
                direct = ck._restorer._direct
                if attempt == 0 and direct is not None:  # the helpers start at the first restore: time them ready
                    direct.wait_ready()
                if attempt and (not best or secs < best["s"]):
                    best = {"s": secs, "stats": dict(handle.stats)}
                if sampler:
                    best["profile"] = sampler.top()
            if dev.type == "cuda":  # device memory the restore keeps: scratch, landing slots, helpers' contexts
                best["kept_MiB"] = (free_before - torch.cuda.mem_get_info(dev)[0]) / 2**20
        return best
    finally:
        restorer_mod.reader_threads = saved_threads
        restorer_mod.PROC_READERS, restorer_mod.DIRECT_HELPERS = saved_procs, saved_direct
        loader_mod.DEVICE_CHECK_READERS, loader_mod.JOIN_CHECKS = saved_cap, saved_join
        sys.setswitchinterval(saved_switch)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="default,piece64,readers8,slots8,big,host,off,switch")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--sample", action="store_true", help="sample the copy thread's frames")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: a smoke test only
    app = build_state(dev, args.tiny)
    nbytes = sum(p.numel() * p.element_size() for p in app["model"].parameters()) * 3
    root = tempfile.mkdtemp(prefix="gpusnap-restore-diag-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        with gpusnap.Checkpointer(root, config=gpusnap.Config.from_env(fsync=False)) as ck:
            cid = ck.save(app).wait().id
        ceiling = rb.h2d_gbps(dev, 1 << 30) or float("nan")  # None on CPU
        print(f"state ~{nbytes / 1e9:.2f} GB; pinned H2D {ceiling:.1f} GB/s; {os.cpu_count()} cores", flush=True)
        rows = []
        for name in args.variants.split(","):
            r = run_variant(name, root, app, cid, dev, args.sample, args.repeat)
            st = r["stats"]
            gbps = st["bytes_read"] / r["s"] / 1e9
            busy = 1 - (st.get("copy_idle_s", 0) + st.get("copy_wait_s", 0)) / max(r["s"], 1e-9)
            rows.append((name, r["s"], gbps, gbps / ceiling, busy, st.get("region_wait_s", 0), st.get("threads"),
                         st.get("pieces"), f"{st.get('direct_batches', 0)}/{st.get('batches')}", st.get("verify_path")))
            print(f"[{name}] {r['s'] * 1e3:.0f} ms, {gbps:.1f} GB/s, device memory kept {r.get('kept_MiB', 0):.0f} MiB; stats {({k: v for k, v in st.items() if k not in ('first_needed',)})}",
                  flush=True)
            for line in r.get("profile", []):
                print(line)
        print("\nvariant | restore ms | GB/s | of H2D | copy thread busy | readers' region wait s | readers | pieces | direct/batches | verify")
        for name, s, gbps, frac, busy, wait, threads, pieces, batches, path in rows:
            print(f"{name} | {s * 1e3:.0f} | {gbps:.1f} | {frac:.0%} | {busy:.0%} | {wait:.1f} | {threads} | {pieces} | {batches} | {path}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
