"""A fresh process's first logits, by loading path, with the restore server among them (issue 23).

The parent builds a Llama-style model from a ``transformers`` config (hidden 3072, 26 layers,
bf16, ~3 B parameters; ``--small``: a tiny one), computes its logits for a fixed prompt, and
saves it every way the paths read it, all on ``/dev/shm``: ``save_pretrained``, one
safetensors file, a ``torch.save`` file, a gpusnap checkpoint (saved while a forward runs, so
the manifest records the access order). It starts ``gpusnap serve`` on the checkpoint. Then,
per round and kind, a **fresh** Python process (``cold_start_serve_child.py``) imports
everything, initialises CUDA, and from there (the timed part) builds the model and produces
its first logits through:

- ``from_pretrained``: ``LlamaForCausalLM.from_pretrained(dir, dtype=bf16, device_map=device)``
- ``load_file``: ``safetensors.torch.load_file(file, device=device)`` + ``load_state_dict(assign=True)``
- ``torch_load``: ``torch.load(file, mmap=True, map_location=device)`` + ``load_state_dict(assign=True)``
- ``eager``: ``gpusnap.empty_model`` + ``ckpt.restore`` from the files (``restore_from_server="off"``)
- ``lazy``: ``gpusnap.cold_start`` from the files
- ``server``: ``gpusnap.cold_start`` served by ``gpusnap serve`` (``restore_from_server="on"``)
- ``server-flat``: the same with every parameter a view of one device buffer (one IPC handle)
- ``lazy-warm``, ``server-warm``: ``lazy`` and ``server`` with ``cold_start(warm_up=...)``: a
  forward on the prompt runs on a side thread while the weights load

Each child also times a second forward (``second_logits``): the forward's own compute, warm.

(the baselines build with parameters on the meta device, as ``empty_model`` does; gpusnap's
Checkpointers run with ``warm_up_kernels=False``: a serving process does not save). Every
run's logits are compared bit for bit with the source model's. Logs go to ``--out``
(one per child, the server's, ``results.json``); the table comes last. Everything the run
put on ``/dev/shm`` is removed at the end, and the server stopped, on error too.

Run (GPU machine, repository root): ``PYTHONPATH=src python3 benchmarks/cold_start_serve.py
--out cold-serve`` (``--small`` for a quick check; ``--kinds server,eager``; ``--rounds 2``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

KINDS = ("from_pretrained", "load_file", "torch_load", "eager", "lazy", "lazy-warm", "server", "server-warm", "server-flat")
FULL = {"hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 26, "num_attention_heads": 24,
        "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": True}
SMALL = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 1024, "tie_word_embeddings": True}
CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cold_start_serve_child.py")
CHILD_TIMEOUT_S = 600
READY_TIMEOUT_S = 600  # the server reads, checks and page-locks the whole checkpoint first


def build_model(cfg: Any) -> Any:
    """``LlamaForCausalLM(cfg)`` in bf16, as ``from_pretrained(dtype=bf16)`` makes it: the
    default dtype set while it is built, so buffers made in float32 on purpose (rotary
    ``inv_freq``) stay float32 (a ``.to(bf16)`` would round them, and the logits would differ)."""
    import torch
    from transformers import LlamaForCausalLM

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        return LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(previous)


def prepare(work: str, args: argparse.Namespace, *, every_format: bool = True) -> int:
    """Build, compute the expected logits, save every format into ``work`` (without
    ``every_format``: the Hugging Face directory and the gpusnap root only); bytes of weights."""
    import torch
    from safetensors.torch import save_model
    from transformers import LlamaConfig

    import gpusnap

    dev = torch.device(args.device)
    cfg = LlamaConfig(**(SMALL if args.small else FULL), max_position_embeddings=max(2048, args.prompt))
    cfg.to_json_file(os.path.join(work, "config.json"))
    torch.manual_seed(0)
    with torch.device(dev):
        model = build_model(cfg)
    ids = (torch.arange(args.prompt, device=dev).unsqueeze(0) * 7919) % cfg.vocab_size
    with torch.no_grad():
        expected = model(input_ids=ids, use_cache=False).logits
    torch.save(ids.cpu(), os.path.join(work, "ids.pt"))
    torch.save(expected.cpu(), os.path.join(work, "expected.pt"))
    nbytes = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    step = time.perf_counter()
    model.save_pretrained(os.path.join(work, "hf"))
    if every_format:
        save_model(model, os.path.join(work, "model.safetensors"))
        torch.save(model.state_dict(), os.path.join(work, "model.pt"))
    with gpusnap.Checkpointer(os.path.join(work, "ck"), config=gpusnap.Config.from_env(fsync=False)) as ck:
        pending = ck.save({"model": model})
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)  # inside the save window: the manifest records the order
        pending.wait()
    del model
    if dev.type == "cuda":
        torch.cuda.empty_cache()  # (the fresh processes measured next need the device memory)
    print(f"model: {nbytes / 1e9:.2f} GB of weights, saved {4 if every_format else 2} ways under {work} in "
          f"{time.perf_counter() - step:.1f} s", flush=True)
    return nbytes


class ServeProc:
    """``gpusnap serve`` on the checkpoint, its output copied to a log as it comes."""

    def __init__(self, work: str, env: dict[str, str], device: str, log: str) -> None:
        self.log = open(log, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen([sys.executable, "-m", "gpusnap", "serve", os.path.join(work, "ck"), "--json",
                                      "--device", device], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env)
        self.ready = threading.Event()
        self.ready_event: dict[str, Any] = {}
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.write(line)
            self.log.flush()
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("event") == "ready":
                self.ready_event = event
                self.ready.set()
        self.ready.set()

    def wait_ready(self) -> bool:
        return self.ready.wait(READY_TIMEOUT_S) and bool(self.ready_event.get("held"))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def run_child(kind: str, r: int, work: str, args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    log = os.path.join(args.out, f"round{r}-{kind}.log")
    started = time.time()
    try:
        proc = subprocess.run([sys.executable, CHILD, kind, work, args.device], capture_output=True, text=True,
                              timeout=CHILD_TIMEOUT_S, env=env, check=False)
        out, err, code = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        out, err, code = str(exc.stdout or ""), str(exc.stderr or ""), "timeout"
    with open(log, "w") as f:
        f.write(f"$ {CHILD} {kind} {work} {args.device}\nexit {code}, {time.time() - started:.1f} s\n"
                f"--- stdout\n{out}\n--- stderr\n{err}")
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    if code != 0 or not lines:
        print(f"round {r} {kind}: FAILED (exit {code}; {log})\n{err[-1500:]}", flush=True)
        return {"kind": kind, "round": r, "failed": True, "exit": code}
    res: dict[str, Any] = json.loads(lines[-1][len("RESULT "):])
    res.update(round=r, wall_s=time.time() - started)
    m, st = res["marks"], res["stats"]
    served = st.get("served") or {}
    print(f"round {r} {kind:15s}: first logits {m['first_logits']:.3f} s (restore returned {m['restore_returned']:.3f} s, "
          f"imports {m['imports_s']:.1f} s), equal {res['equal']}, source {st.get('source', '-')}"
          + (f", fallback: {st['server_fallback']}" if st.get("server_fallback") else "")
          + (f", server: {served.get('handles')} handles, copy {served.get('server_copy_s')} s, "
             f"reply {served.get('reply_s', 0):.3f} s" if served else ""), flush=True)
    return res


def table(runs: list[dict[str, Any]], nbytes: int) -> list[str]:
    rows = [("kind | round | first logits s | restore returned s | second forward s | GB/s to first logits | "
             "logits bit-equal | source"), "---|---:|---:|---:|---:|---:|---|---"]
    for res in runs:
        if res.get("failed"):
            rows.append(f"{res['kind']} | {res['round']} | FAILED | - | - | - | - | -")
            continue
        m = res["marks"]
        second = m.get("second_logits", 0.0) - m.get("restore_done", m["first_logits"])
        rows.append(f"{res['kind']} | {res['round']} | {m['first_logits']:.3f} | {m['restore_returned']:.3f} | {second:.3f} | "
                    f"{nbytes / 1e9 / m['first_logits']:.1f} | {res['equal']} | {res['stats'].get('source', '-')}")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="a tiny model (a quick check; runs on CPU too)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    ap.add_argument("--device", default=None, help="default: cuda when present, else cpu")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens of the first forward")
    ap.add_argument("--out", default="cold_start_serve_out", help="logs and results.json go here")
    args = ap.parse_args()
    kinds = [k for k in args.kinds.split(",") if k]
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        ap.error(f"--kinds: unknown {', '.join(bad) or '(none given)'}; pick from {', '.join(KINDS)}")
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    os.makedirs(args.out, exist_ok=True)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    work = tempfile.mkdtemp(prefix="gpusnap-cold-serve-", dir=shm)
    runtime = os.path.join(work, "run")  # the server's socket: private to this run
    os.mkdir(runtime, 0o700)
    env = {**os.environ, "XDG_RUNTIME_DIR": runtime,
           "PYTHONPATH": os.pathsep.join(p for p in (os.path.abspath(os.path.join(os.path.dirname(CHILD), "..", "src")),
                                                     os.environ.get("PYTHONPATH", "")) if p)}
    server: ServeProc | None = None
    runs: list[dict[str, Any]] = []
    try:
        nbytes = prepare(work, args)
        if any(k.startswith("server") for k in kinds):
            started = time.perf_counter()
            server = ServeProc(work, env, args.device, os.path.join(args.out, "server.log"))
            ok = server.wait_ready()
            print(f"gpusnap serve: {'ready' if ok else 'NOT READY'} after {time.perf_counter() - started:.1f} s "
                  f"({server.ready_event.get('held')})", flush=True)
        for r in range(args.rounds):
            for kind in kinds:
                runs.append(run_child(kind, r, work, args, env))
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"device": args.device, "bytes": nbytes, "small": args.small, "runs": runs}, f, indent=2)
        print("\n" + "\n".join(table(runs, nbytes)), flush=True)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0 if runs and all(not r.get("failed") and r["equal"] for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
