"""Suspend and resume in place (issue 41): how much device memory a suspend frees, how long
suspend and resume take, what a lazy resume's first forward costs, and whether a compiled
model still runs without recompiling.

A Llama-style model from a ``transformers`` config (hidden 3072, 26 layers, 24 heads, 8 key/value
heads, intermediate 8192, vocabulary 128256, tied embeddings: ~3.0 B parameters, ~6.0 GB in
bf16; ``--tiny``: a small one) is built on the device and run once on a fixed prompt (the
expected logits). Then, per round (``--rounds``, default 2; the first suspend pays for
page-locking its host memory, later ones reuse it):

- ``suspend``: ``gpusnap.moving.suspend({"model": model})`` after ``torch.cuda.empty_cache()``
  (so the memory freed is the state's): seconds, host allocation seconds, device memory freed
  (the driver's ``cudaMemGetInfo`` after minus before) as a share of the state's bytes;
- a kernel on a suspended tensor (it reads the page-locked host copy): its result checked;
- ``resume``: ``resume(lazy=False)``: seconds and GB/s, then a forward (its logits bit-equal?);
- ``eager+fwd``: suspend, ``resume(lazy=False)`` and the first forward until its logits are
  ready (the baseline of the next);
- ``lazy+fwd``: suspend, ``resume(lazy=True)`` and the first forward until its logits are
  ready, bit-equality of those logits with the expected ones, ``resume()``'s return time and
  the seconds until every byte was back;
- ``compiled``: every decoder layer compiled (``layer.compile()``, regional compilation: one
  graph serves the 26 layers), warmed, then suspended and resumed: its logits bit-equal to its
  own before, and TorchDynamo's ``unique_graphs`` counter unchanged (no recompilation).

Run (GPU machine, repository root): ``PYTHONPATH=src python3 benchmarks/suspend_resume.py
--out suspend.json`` (about 1-2 minutes on an H100, compile included); ``--device cpu
--tiny`` for a quick check anywhere. The JSON goes to ``--out``; a short table comes last.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from typing import Any

FULL = {"hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 26, "num_attention_heads": 24,
        "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": True}
TINY = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512, "tie_word_embeddings": True}


def build(cfg: Any, device: Any) -> Any:
    """``LlamaForCausalLM(cfg)`` in bf16, built on ``device`` (buffers kept float32 on purpose stay so)."""
    import torch
    from transformers import LlamaForCausalLM

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            return LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(previous)


def sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def logits(model: Any, ids: Any) -> Any:
    import torch

    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def one_round(model: Any, ids: Any, expected: Any, device: Any, index: int) -> dict[str, Any]:
    import torch

    from gpusnap.moving import suspend

    out: dict[str, Any] = {"round": index}
    probe = model.model.norm.weight.detach()
    probe_sum = float(probe.float().sum())
    if device.type == "cuda":
        torch.cuda.empty_cache()
    s = suspend({"model": model}, device=device)
    st = s.stats
    out.update(bytes=st.bytes, storages=st.storages, suspend_s=st.suspend_s, host_alloc_s=st.host_alloc_s,
               host_reused=st.host_reused, device_freed_bytes=st.device_freed_bytes,
               allocator_released_bytes=st.allocator_released_bytes, freed_pct=100.0 * st.device_freed_bytes / st.bytes)
    out["suspended_kernel_ok"] = float(probe.float().sum()) == probe_sum  # a kernel over the host copy
    s.resume(lazy=False)
    st = s.stats
    out.update(resume_s=st.resume_s, resume_gbps=st.resume_gbps)
    out["resume_logits_equal"] = bool(torch.equal(logits(model, ids), expected))

    s = suspend({"model": model}, device=device)
    started = time.perf_counter()
    s.resume(lazy=False)
    got = logits(model, ids)
    sync(device)
    out["eager_first_forward_s"] = time.perf_counter() - started
    del got

    s = suspend({"model": model}, device=device)
    started = time.perf_counter()
    s.resume(lazy=True)
    returned = time.perf_counter() - started
    got = logits(model, ids)
    sync(device)
    out["lazy_first_forward_s"] = time.perf_counter() - started
    st = s.wait()
    out.update(lazy_return_s=returned, lazy_resume_s=st.resume_s, lazy_waits=st.waits,
               lazy_logits_equal=bool(torch.equal(got, expected)))
    return out


def compiled_check(model: Any, ids: Any, device: Any) -> dict[str, Any]:
    import torch
    import torch._dynamo
    from torch._dynamo.utils import counters

    from gpusnap.moving import suspend

    torch._dynamo.reset()
    backend = "inductor" if device.type == "cuda" else "aot_eager"  # (inductor on CPU needs a C++ compiler)
    started = time.perf_counter()
    for layer in model.model.layers:
        layer.compile(backend=backend)
    before = logits(model, ids)
    logits(model, ids)
    sync(device)
    compile_s = time.perf_counter() - started
    graphs = counters["stats"]["unique_graphs"]
    s = suspend({"model": model}, device=device)
    s.resume()
    after = logits(model, ids)
    return {"backend": backend, "compile_s": compile_s, "unique_graphs": graphs,
            "recompiled": counters["stats"]["unique_graphs"] != graphs, "logits_equal": bool(torch.equal(after, before))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="where the JSON results go")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny model (a quick check)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens of the forward")
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()

    import torch
    from transformers import LlamaConfig

    device = torch.device(args.device)
    cfg = LlamaConfig(**(TINY if args.tiny else FULL), max_position_embeddings=max(2048, args.prompt))
    torch.manual_seed(0)
    started = time.perf_counter()
    model = build(cfg, device)
    ids = (torch.arange(args.prompt, device=device).unsqueeze(0) * 7919) % cfg.vocab_size
    expected = logits(model, ids)
    sync(device)
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    print(f"model: {params / 1e9:.2f} B parameters, built in {time.perf_counter() - started:.1f} s", flush=True)

    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "params": params, "config": "tiny" if args.tiny else "full", "rounds": []}
    for index in range(1, args.rounds + 1):
        row = one_round(model, ids, expected, device, index)
        results["rounds"].append(row)
        print(json.dumps(row), flush=True)
    if not args.no_compile:
        results["compiled"] = compiled_check(model, ids, device)
        print(json.dumps(results["compiled"]), flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)

    print(f"\nsuspend/resume of {results['rounds'][0]['bytes'] / 1e9:.2f} GB ({params / 1e9:.2f} B params, bf16) "
          f"on {results['device']}; round 1 pays page-locking, later rounds reuse the host memory")
    head = (f"{'round':>5} {'suspend s':>9} {'pin s':>6} {'freed %':>7} {'resume s':>8} {'GB/s':>6} "
            f"{'eager+fwd s':>11} {'lazy ret s':>10} {'lazy+fwd s':>10} {'lazy all s':>10} {'equal':>5}")
    print(head)
    for r in results["rounds"]:
        equal = r["resume_logits_equal"] and r["lazy_logits_equal"] and r["suspended_kernel_ok"]
        print(f"{r['round']:>5} {r['suspend_s']:>9.3f} {r['host_alloc_s']:>6.3f} {r['freed_pct']:>7.1f} "
              f"{r['resume_s']:>8.3f} {r['resume_gbps'] or 0:>6.1f} {r['eager_first_forward_s']:>11.3f} "
              f"{r['lazy_return_s']:>10.4f} {r['lazy_first_forward_s']:>10.3f} {r['lazy_resume_s'] or 0:>10.3f} "
              f"{'yes' if equal else 'NO':>5}")
    if "compiled" in results:
        c = results["compiled"]
        print(f"compiled ({c['backend']}, every decoder layer): {c['unique_graphs']} graphs, compiled in "
              f"{c['compile_s']:.1f} s; after suspend/resume: recompiled={c['recompiled']}, "
              f"logits equal={c['logits_equal']}")


if __name__ == "__main__":
    main()
