"""Live migration between processes (issue 41): the downtime of moving a running program, and
whether the moved program goes on exactly as an unmoved one would.

Both parts run their source in this process and start the target as a child process on the
same device (``--role ...``); the transport is a private directory under ``/dev/shm``.
Times are ``time.monotonic()`` (``CLOCK_MONOTONIC``: one clock for every process of the
machine).

(a) **serving**: a Llama-style ~3B model in bf16 (hidden 3072, 26 layers, 24 heads, 8 key/value
    heads, intermediate 8192, vocabulary 128256, tied embeddings) generates greedily with a
    static KV cache of ``--max-len`` positions (10240: ~1.0 GiB in bf16), held as one
    contiguous ``[positions, kv heads, head dim]`` buffer per layer and key/value (the cache's
    tensors are views of them, so a token writes one contiguous row: one chunk per buffer).
    The source generates, calling ``precopy()`` after every token (a round starts when none
    is in flight); once the target has applied the newest round, the source generates one
    last token and hands off. Downtime: the source's last token ready -> the target's first
    token ready (``downtime_first_token_s``; it includes one decode step, ``decode_s``), and
    -> the target's ``receive()`` returning (``downtime_resume_s``). The target then generates
    ``--tokens`` tokens, compared with the same tokens of the unmoved source.
(b) **training**: the 0.95B Llama of ``gpusnap.bench`` (fp32 weights, bf16 autocast, fused
    AdamW; ``--train-size quick``: batch 4 x 1024, ~11.4 GB of training state) trains with a
    round between steps; once the target is caught up, one more step, then the handoff.
    Downtime: the source's last step done -> the target's ``receive()`` returning. Against it,
    in the same run, a stop-the-world move: a blocking ``Checkpointer.save`` (a fast tier in
    ``/dev/shm``) in the source plus an eager ``restore`` of it in the (warm) target. The
    target then trains ``--steps`` steps; every tensor of its state (weights, moments, step
    counters) is compared, by device hashes, with the unmoved source after the same steps.

Run (GPU machine, repository root): ``PYTHONPATH=src python3 benchmarks/migrate_bench.py
--out migrate.json`` (about 3 minutes on an H100); ``--device cpu --tiny`` for a quick check
anywhere; ``--parts serve`` or ``--parts train`` for one part. The JSON goes to ``--out``; a
short table comes last.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

FULL = {"hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 26, "num_attention_heads": 24,
        "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": True}
TINY = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512, "tie_word_embeddings": True}
PROMPT = 32
CHILD_TIMEOUT_S = 600


def clock() -> float:
    return time.monotonic()


def sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- (a) serving ---------------------------------------------------------------------------------
def llama_config(tiny: bool, max_len: int, layers: int | None = None, attn: str = "") -> Any:
    from transformers import LlamaConfig

    shape = dict(TINY if tiny else FULL)
    if layers:
        shape["num_hidden_layers"] = layers
    cfg = LlamaConfig(**shape, max_position_embeddings=max(max_len, 2048))
    if attn:  # (eager: attention as plain matmuls and a softmax, no fused SDPA kernel)
        cfg._attn_implementation = attn
    return cfg


def build_model(cfg: Any, device: Any, *, empty: bool) -> Any:
    """``LlamaForCausalLM(cfg)`` in bf16 on ``device``, built as a target that receives its
    parameters builds it (``gpusnap.empty_model``); unless ``empty``, the parameters are then
    drawn (seeded, on the device). Both sides build alike on purpose: the buffers a model
    computes at build time and no state holds (rotary ``inv_freq``, non-persistent) differ
    in their last bits between a build on the GPU and one on the CPU, and greedy tokens
    then part ways after a few steps, moved or not."""
    import torch
    from transformers import LlamaForCausalLM

    import gpusnap

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # (buffers made in float32 on purpose stay so)
    try:
        model = gpusnap.empty_model(lambda: LlamaForCausalLM(cfg), device).eval()
    finally:
        torch.set_default_dtype(previous)
    if not empty:
        g = torch.Generator(device=device).manual_seed(0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, 0.02, generator=g)
    return model


def serving_state(cfg: Any, device: Any, max_len: int, model: Any) -> tuple[dict[str, Any], Any]:
    """app_state of a generating model and its cache: per layer one contiguous key and one
    value buffer ``[max_len, kv heads, head dim]`` whose ``[1, heads, max_len, dim]`` views
    are the static cache's tensors, the cache's lengths, the tokens and their count."""
    import torch
    from transformers.cache_utils import StaticCache

    kv, hd = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    cache = StaticCache(config=cfg, max_cache_len=max_len)
    cache.early_initialization(1, kv, hd, torch.bfloat16, device)
    buffers = []
    for layer in cache.layers:
        k = torch.zeros(max_len, kv, hd, dtype=torch.bfloat16, device=device)
        v = torch.zeros(max_len, kv, hd, dtype=torch.bfloat16, device=device)
        layer.keys, layer.values = k.permute(1, 0, 2).unsqueeze(0), v.permute(1, 0, 2).unsqueeze(0)
        buffers += [k, v]
    app = {"model": model, "kv": buffers, "lengths": [layer.cumulative_length for layer in cache.layers],
           "tokens": torch.zeros(max_len, dtype=torch.long, device=device), "n": 0}
    return app, cache


def serving_digest(app: dict[str, Any]) -> dict[str, str]:
    """Per tensor the serving program holds (the model's parameters and every buffer,
    non-persistent ones too, the cache, the tokens), a digest of its bytes; and ``n``."""
    named = {f"model/{k}": v for k, v in app["model"].state_dict(keep_vars=False).items()}
    named.update({f"model/{k}": v for k, v in app["model"].named_buffers()})
    named.update({f"kv/{i}": t for i, t in enumerate(app["kv"])})
    named.update({f"lengths/{i}": t for i, t in enumerate(app["lengths"])})
    named["tokens"] = app["tokens"]
    out = digests(named)
    out["n"] = str(app["n"])
    return out


def digests(named: dict[str, Any]) -> dict[str, str]:
    """A digest of each tensor's bytes (device hashes of 1 MiB chunks)."""
    import hashlib

    import torch

    from gpusnap.kernels.chunk_hash import chunk_hashes, hashes_to_hex

    out = {}
    for name, t in named.items():
        flat = t.detach().contiguous().view(-1).view(torch.uint8)
        out[name] = hashlib.sha256("".join(hashes_to_hex(chunk_hashes(flat, 1 << 20))).encode()).hexdigest()
    return out


def generate(app: dict[str, Any], cache: Any, k: int, rows: list[Any] | None = None) -> None:
    """``k`` greedy tokens; the first call of a fresh state reads the prompt. ``rows``
    collects each step's logits (compared across the processes after the timing)."""
    import torch

    model, tokens = app["model"], app["tokens"]
    with torch.inference_mode():
        for _ in range(k):
            n = app["n"]
            if n == 0:
                prompt = (torch.arange(PROMPT, device=tokens.device) * 7919 + 13) % model.config.vocab_size
                tokens[:PROMPT] = prompt
                ids, pos, n = prompt.view(1, -1), torch.arange(PROMPT, device=tokens.device), PROMPT
            else:
                ids, pos = tokens[n - 1 : n].view(1, 1), torch.arange(n - 1, n, device=tokens.device)
            logits = model(input_ids=ids, past_key_values=cache, cache_position=pos, use_cache=True).logits
            tokens[n] = logits[0, -1].argmax()
            if rows is not None:
                rows.append(logits[0, -1].clone())
            app["n"] = n + 1


def row_digests(rows: list[Any]) -> list[str]:
    """A short digest of each logits row's bytes."""
    import hashlib

    import torch

    return [hashlib.sha256(r.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()[:16] for r in rows]


def first_difference(a: list[Any], b: list[Any]) -> Any:
    """The first index where ``a`` and ``b`` differ (None: equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def serve_target(args: argparse.Namespace) -> None:
    """The new process: build the model empty and the cache, receive, generate."""
    import torch

    from gpusnap.migrate import Target

    device = torch.device(args.device)
    cfg = llama_config(args.tiny, args.max_len, args.layers, args.attn)
    model = build_model(cfg, device, empty=True)
    app, cache = serving_state(cfg, device, args.max_len, model)
    generate(app, cache, 2)  # warm: a serving process loads its kernels before it takes traffic
    app["n"] = 0  # (what this wrote, the first round overwrites)
    sync(device)
    sampler = sampler_if(args)
    say({"ready": True})
    with Target(args.address, verify=args.verify, on_round=lambda r: say({
            "applied": r.seq, "bytes_moved": r.bytes_moved, "apply_s": r.apply_s, "final": r.final})) as dst:
        info = dst.receive(app, lazy=args.lazy)
        resumed = clock()
        profile = [] if sampler is None else sampler.stop().report(resumed - info.handoff_s - 0.005, resumed)
        digest, digest_s = None, 0.0
        if not args.lazy:  # (a lazy one's bytes are still arriving: its tokens are the check)
            digest = serving_digest(app)
            sync(device)
            digest_s = clock() - resumed
        start, rows = app["n"], []
        generate(app, cache, 1, rows)
        sync(device)
        first = clock() - digest_s
        generate(app, cache, args.tokens - 1, rows)
        sync(device)
        done = clock()
        dst.wait()
    say({"done": True, "resumed": resumed, "first_token": first, "decode_s": (done - first - digest_s) / max(1, args.tokens - 1),
         "digest": digest, "tokens": app["tokens"][start : app["n"]].tolist(), "handoff_s": info.handoff_s,
         "logits": row_digests(rows),
         "rounds": [r.__dict__ for r in info.rounds], "profile": profile})


def sampler_if(args: argparse.Namespace) -> Any:
    """A started StackSampler with ``--sample`` (where the handoff's time goes), else None."""
    if not args.sample:
        return None
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from stack_sample import StackSampler

    return StackSampler().start()


def serving(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from gpusnap.migrate import Source

    device = torch.device(args.device)
    cfg = llama_config(args.tiny, args.max_len, args.layers, args.attn)
    torch.manual_seed(0)
    model = build_model(cfg, device, empty=False)
    app, cache = serving_state(cfg, device, args.max_len, model)
    kv_bytes = sum(t.numel() * t.element_size() for t in app["kv"])
    weight_bytes = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    generate(app, cache, 1)
    out: dict[str, Any] = {"weights_bytes": weight_bytes, "kv_bytes": kv_bytes, "max_len": args.max_len}
    with Source(app, fast_handoff=not args.general) as src:
        child = Child("serve-target", args, src.address)
        try:
            child.expect("ready")
            warm = clock()
            while True:  # serving goes on; a round after each token while none is in flight
                generate(app, cache, 1)
                src.precopy()
                newest = src.rounds[-1].seq if src.rounds else 0
                if newest >= 2 and child.applied >= newest and clock() - warm > args.warm_s:
                    break
                if app["n"] > args.max_len - args.tokens - 8:
                    raise RuntimeError("the cache filled before the target caught up: raise --max-len")
            generate(app, cache, 1)  # a round of its own, applied by the target before the last token
            src.precopy(wait=True)
            child.wait_applied(src.rounds[-1].seq)
            generate(app, cache, 1)  # the source's last token
            sync(device)
            sampler = sampler_if(args)
            last = clock()
            handed = src.handoff()
            profile = [] if sampler is None else sampler.stop().report(last, clock())
            result = child.expect("done")
            held = serving_digest(app)  # (as handed off: nothing wrote it since; not before: the GPU is the target's)
        finally:
            child.close()
    start, rows = app["n"], []  # the unmoved run: the same tokens must follow
    mutable = app["kv"] + app["lengths"] + [app["tokens"]]  # (what decoding writes; the weights it does not)
    kept = [t.clone() for t in mutable]
    generate(app, cache, args.tokens, rows)
    unmoved = app["tokens"][start : app["n"]].tolist()
    logits = row_digests(rows)
    # the control: the unmoved run again from the same bytes, in the same process
    for t, k in zip(mutable, kept):
        t.copy_(k)
    del kept
    app["n"], again = start, []
    generate(app, cache, args.tokens, again)
    again_differing = first_difference(row_digests(again), logits)
    out.update(
        verify=args.verify, lazy=args.lazy, tokens=len(unmoved), tokens_equal=result["tokens"] == unmoved,
        first_token_differing=first_difference(result["tokens"], unmoved),
        first_logits_differing=first_difference(result["logits"], logits),
        unmoved_again_first_logits_differing=again_differing,
        moved_tokens=result["tokens"], unmoved_tokens=unmoved, state_equal=None if result["digest"] is None else result["digest"] == held,
        differing=sorted(k for k in held if (result["digest"] or held).get(k) != held[k])[:8],
        downtime_first_token_s=result["first_token"] - last, downtime_resume_s=result["resumed"] - last,
        handoff_s=handed.handoff_s, target_handoff_s=result["handoff_s"], decode_s=result["decode_s"],
        fast=handed.round.fast, general_why=handed.general_why,
        source_rounds=[r.__dict__ for r in handed.rounds], target_rounds=result["rounds"],
        last_delta_bytes=result["rounds"][-1]["bytes_moved"], state_bytes=handed.round.bytes_total,
        profile_source=profile, profile_target=result["profile"],
    )
    return out


# -- (b) training --------------------------------------------------------------------------------
def train_workload(args: argparse.Namespace) -> Any:
    import torch

    from gpusnap.bench.workloads import build_workload

    device = torch.device(args.device)
    size = "tiny" if args.tiny else args.train_size
    return build_workload("llama", device, size=size, seed=0)  # (the same data: it is no state)


def state_digest(wl: Any) -> dict[str, str]:
    """Per tensor of the training state, a digest of its bytes (device hashes of 1 MiB chunks)."""
    import hashlib

    from gpusnap.kernels.chunk_hash import chunk_hashes, hashes_to_hex

    out = {}
    for name, t in wl.tensors().items():
        flat = t.detach().contiguous().view(-1).view(__import__("torch").uint8)
        out[name] = hashlib.sha256("".join(hashes_to_hex(chunk_hashes(flat, 1 << 20))).encode()).hexdigest()
    out["step"] = str(wl.app_state["step"])
    return out


def train_target(args: argparse.Namespace) -> None:
    import gpusnap
    from gpusnap.migrate import Target

    wl = train_workload(args)
    device = wl.device
    say({"ready": True})
    with Target(args.address, verify=args.verify, on_round=lambda r: say({
            "applied": r.seq, "bytes_moved": r.bytes_moved, "apply_s": r.apply_s, "final": r.final})) as dst:
        info = dst.receive(wl.app_state)
        resumed = clock()
    received = state_digest(wl)  # (the state as received: compared with the source's as handed off)
    sync(device)
    digest_s = clock() - resumed
    wl.step(None)
    sync(device)
    first = clock() - digest_s
    for _ in range(args.steps - 1):
        wl.step(None)
    sync(device)
    say({"done": True, "resumed": resumed, "first_step": first, "handoff_s": info.handoff_s,
         "rounds": [r.__dict__ for r in info.rounds], "digest": state_digest(wl), "received": received})
    line = sys.stdin.readline().split()  # "restore ROOT FAST": the stop-the-world move's restore
    if line and line[0] == "restore":
        with gpusnap.Checkpointer(line[1], fast_root=line[2]) as ckpt:
            started = time.perf_counter()
            ckpt.restore(wl.app_state)
            sync(device)
            say({"restored": True, "restore_s": time.perf_counter() - started})


def training(args: argparse.Namespace) -> dict[str, Any]:
    import gpusnap
    from gpusnap.migrate import Source

    wl = train_workload(args)
    device = wl.device
    for _ in range(2):
        wl.step(None)
    out: dict[str, Any] = {"config": wl.config, "state_bytes": wl.state_bytes()}
    shm = tempfile.mkdtemp(prefix="gpusnap-migrate-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        with Source(wl.app_state, fast_handoff=not args.general) as src:
            child = Child("train-target", args, src.address)
            try:
                child.expect("ready")
                while True:  # training goes on; a round between steps while none is in flight
                    wl.step(None)
                    src.precopy()
                    newest = src.rounds[-1].seq if src.rounds else 0
                    if newest >= 1 and child.applied >= newest:
                        break
                wl.step(None)
                src.precopy(wait=True)
                child.wait_applied(src.rounds[-1].seq)
                wl.step(None)  # the source's last step
                sync(device)
                sampler = sampler_if(args)
                last = clock()
                handed = src.handoff()
                profile = [] if sampler is None else sampler.stop().report(last, clock())
                result = child.expect("done")
                held = state_digest(wl)  # (as handed off: nothing wrote it since; not before: the GPU is the target's)
                for _ in range(args.steps):  # the unmoved run
                    wl.step(None)
                sync(device)
                unmoved = state_digest(wl)
                # the stop-the-world move of the same state: a blocking save here, a restore there
                root, fast = os.path.join(shm, "root"), os.path.join(shm, "fast")
                save_s, restored = float("nan"), {"restore_s": float("nan")}
                if args.stw:
                    with gpusnap.Checkpointer(root, fast_root=fast, promote_every=1 << 30) as ckpt:
                        started = time.perf_counter()
                        ckpt.save(wl.app_state, blocking=True)
                        save_s = time.perf_counter() - started
                        child.send(f"restore {root} {fast}")
                        restored = child.expect("restored")
            finally:
                child.close()
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    moved = result["digest"]
    out.update(
        steps=args.steps, bit_exact=moved == unmoved,
        differing=sorted(k for k in unmoved if moved.get(k) != unmoved[k])[:5],
        state_equal=result["received"] == held,
        differing_at_handoff=sorted(k for k in held if result["received"].get(k) != held[k])[:5],
        deterministic=args.deterministic,
        downtime_resume_s=result["resumed"] - last, downtime_first_step_s=result["first_step"] - last,
        profile_source=profile, handoff_s=handed.handoff_s, target_handoff_s=result["handoff_s"],
        fast=handed.round.fast, general_why=handed.general_why,
        stop_the_world_s=save_s + restored["restore_s"], stw_save_s=save_s, stw_restore_s=restored["restore_s"],
        source_rounds=[r.__dict__ for r in handed.rounds], target_rounds=result["rounds"],
        last_delta_bytes=result["rounds"][-1]["bytes_moved"],
    )
    return out


# -- the child process ---------------------------------------------------------------------------
def say(doc: dict[str, Any]) -> None:
    print(json.dumps(doc), flush=True)


class Child:
    """A target process: its JSON lines read on a thread (rounds applied counted as they come)."""

    def __init__(self, role: str, args: argparse.Namespace, address: str) -> None:
        cmd = [sys.executable, os.path.abspath(__file__), "--role", role, "--address", address, "--device",
               args.device, "--max-len", str(args.max_len), "--tokens", str(args.tokens), "--steps", str(args.steps),
               "--train-size", args.train_size, "--verify", args.verify, "--layers", str(args.layers or 0), "--attn", args.attn] + (["--tiny"] if args.tiny else []) + (
                   ["--lazy"] if args.lazy else []) + (["--sample"] if args.sample else []) + (
                   [] if args.deterministic else ["--nondeterministic"])
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.applied = 0
        self.docs: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                doc = json.loads(line)
            except ValueError:
                print(line, end="", file=sys.stderr)
                continue
            if "applied" in doc:
                with self._cond:
                    self.applied = max(self.applied, doc["applied"])
                    self._cond.notify_all()
            else:
                self.docs.put(doc)
        self.docs.put(None)

    def expect(self, key: str) -> dict[str, Any]:
        doc = self.docs.get(timeout=CHILD_TIMEOUT_S)
        if doc is None or key not in doc:
            raise RuntimeError(f"the target process failed (exit {self.proc.wait(60)}), expecting {key!r}: {doc}")
        return doc

    def wait_applied(self, seq: int) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: self.applied >= seq or self.proc.poll() is not None, CHILD_TIMEOUT_S):
                raise RuntimeError(f"the target did not apply round {seq}")
        if self.applied < seq:
            raise RuntimeError(f"the target process ended (exit {self.proc.poll()}) before applying round {seq}")

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            self.proc.wait(CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# -- main ----------------------------------------------------------------------------------------
def table(results: dict[str, Any]) -> str:
    rows = []
    s = results.get("serving")
    if s:
        rows += [
            ("serving: downtime, last token -> first token", f"{s['downtime_first_token_s'] * 1e3:.1f} ms"),
            ("serving: downtime, last token -> receive() returned", f"{s['downtime_resume_s'] * 1e3:.1f} ms"),
            ("serving: one decode step", f"{s['decode_s'] * 1e3:.1f} ms"),
            ("serving: handoff() in the source", f"{s['handoff_s'] * 1e3:.1f} ms"),
            ("serving: the target's last apply", f"{s['target_handoff_s'] * 1e3:.1f} ms"),
            ("serving: handoff path", "fast" if s["fast"] else f"general ({s['general_why']})"),
            ("serving: last delta / state", f"{s['last_delta_bytes'] / 2**20:.1f} MiB / {s['state_bytes'] / 2**30:.2f} GiB"),
            ("serving: tokens equal to the unmoved run", f"{s['tokens_equal']} ({s['tokens']} tokens)"),
            ("serving: first token / logits row that differ", f"{s['first_token_differing']} / {s['first_logits_differing']}"),
            ("serving: the unmoved run again, same process: first logits row that differs",
             f"{s['unmoved_again_first_logits_differing']}"),
            ("serving: state equal at the handoff", f"{s['state_equal']} {' '.join(s['differing'])}".rstrip()),
        ]
    t = results.get("training")
    if t:
        rows += [
            ("training: downtime, last step -> receive() returned", f"{t['downtime_resume_s']:.3f} s"),
            ("training: stop-the-world save + restore", f"{t['stop_the_world_s']:.3f} s "
                                                        f"({t['stw_save_s']:.3f} + {t['stw_restore_s']:.3f})"),
            ("training: handoff path", "fast" if t["fast"] else f"general ({t['general_why']})"),
            ("training: last delta / state", f"{t['last_delta_bytes'] / 2**30:.2f} / {t['state_bytes'] / 2**30:.2f} GiB"),
            ("training: state equal at the handoff", f"{t.get('state_equal')} {t.get('differing_at_handoff') or ''}"),
            ("training: bit-exact after the move", f"{t['bit_exact']} ({t['steps']} steps)"),
        ]
    width = max(len(r[0]) for r in rows) if rows else 0
    return "\n".join(f"{a:<{width}}  {b}" for a, b in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="where the JSON results go")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny models (a quick check, CPU too)")
    parser.add_argument("--parts", default="serve,train")
    parser.add_argument("--max-len", type=int, default=10240, help="KV cache positions (serving)")
    parser.add_argument("--layers", type=int, default=0,
                        help="the serving model's layers (0: its own; --tiny --layers 26 has the full model's tensor count)")
    parser.add_argument("--attn", default="", help="the serving model's attention implementation ('': "
                        "transformers' default, sdpa; eager: plain matmuls and a softmax)")
    parser.add_argument("--tokens", type=int, default=32, help="tokens compared after the move (serving)")
    parser.add_argument("--warm-s", type=float, default=2.0, help="seconds of rounds before the handoff (serving)")
    parser.add_argument("--steps", type=int, default=3, help="steps compared after the move (training)")
    parser.add_argument("--general", action="store_true", help="Source(fast_handoff=False): the last round as a checkpoint")
    parser.add_argument("--train-size", default="quick", help="gpusnap.bench llama size (quick: batch 4)")
    parser.add_argument("--verify", default="auto", help="the target's verify mode (Target(verify=...))")
    parser.add_argument("--lazy", action="store_true", help="the serving target receives with lazy=True")
    parser.add_argument("--sample", action="store_true",
                        help="sample every thread's stack during the handoffs (and the serving target's last apply)")
    parser.add_argument("--nondeterministic", dest="deterministic", action="store_false",
                        help="leave torch's nondeterministic kernels on (by default both processes run "
                             "deterministic algorithms, so that an unmoved run is a reference at all)")
    parser.add_argument("--no-stw", dest="stw", action="store_false",
                        help="skip the stop-the-world comparison of the training part")
    parser.add_argument("--role", default="main", help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tiny and args.max_len == 10240:
        args.max_len = 512
    if args.deterministic:  # (before CUDA starts: cuBLAS reads it then)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        import torch

        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = False  # (else every torch.empty is written: timings)
    if args.role == "serve-target":
        return serve_target(args)
    if args.role == "train-target":
        return train_target(args)
    if not args.out:
        parser.error("--out is required")
    import torch

    results: dict[str, Any] = {"device": args.device, "host": platform.node(), "tiny": args.tiny,
                               "torch": torch.__version__}
    if args.device.startswith("cuda"):
        results["gpu"] = torch.cuda.get_device_name(torch.device(args.device))
    parts = args.parts.split(",")
    started = time.perf_counter()
    if "serve" in parts:
        results["serving"] = serving(args)
        print(json.dumps({k: v for k, v in results["serving"].items() if "rounds" not in k and "profile" not in k}),
              flush=True)
        for side in ("source", "target"):
            if results["serving"].get(f"profile_{side}"):
                print(f"-- where the {side}'s handoff time went", *results["serving"][f"profile_{side}"], sep="\n")
        with open(args.out, "w") as f:  # (kept if the training part does not finish)
            json.dump(results, f, indent=1)
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    if "train" in parts:
        results["training"] = training(args)
        print(json.dumps({k: v for k, v in results["training"].items() if "rounds" not in k and "profile" not in k}),
              flush=True)
        if results["training"].get("profile_source"):
            print("-- where the training source's handoff time went", *results["training"]["profile_source"], sep="\n")
    results["total_s"] = time.perf_counter() - started
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(table(results))


if __name__ == "__main__":
    main()
