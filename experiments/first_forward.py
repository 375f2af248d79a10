"""What a fresh process's first forward of the 3.0B Llama-style model pays (issue 23): a diagnosis.

One fresh process per run, the model built with random weights on the GPU (untimed), then,
timed from there, its first and second forward through one variant:

  PYTHONPATH=src python3 experiments/first_forward.py plain        (also: mm-first,
  thread-warm, profile; CUDA_MODULE_LOADING=EAGER in the environment for eager loading)

``mm-first``: one bf16 ``linear`` first (cuBLAS's set-up on its own); ``thread-warm``: a
forward on another thread first, joined (what ``cold_start(warm_up=...)`` leaves the
request); ``profile``: the first forward under cProfile. Prints one ``RESULT {json}`` line.
"""
import cProfile, io, json, os, pstats, sys, threading, time
import torch
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from transformers import LlamaConfig
from cold_start_serve import FULL, build_model

variant = sys.argv[1]
dev = torch.device("cuda"); torch.cuda.init(); torch.empty(1, device=dev); torch.cuda.synchronize()
cfg = LlamaConfig(**FULL, max_position_embeddings=2048)
with torch.device(dev):
    model = build_model(cfg)
ids = (torch.arange(32, device=dev).unsqueeze(0) * 7919) % cfg.vocab_size
torch.cuda.synchronize()
def fwd():
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=False).logits
    torch.cuda.synchronize(); return out
m = {}
t0 = time.perf_counter()
def mark(k): m[k] = round(time.perf_counter() - t0, 4)
if variant == "mm-first":
    a = torch.randn(32, 3072, device=dev, dtype=torch.bfloat16); w = torch.randn(3072, 3072, device=dev, dtype=torch.bfloat16)
    torch.nn.functional.linear(a, w); torch.cuda.synchronize(); mark("first_linear")
    torch.nn.functional.linear(a, w); torch.cuda.synchronize(); mark("second_linear")
if variant == "thread-warm":
    t = threading.Thread(target=fwd); t.start(); t.join(); mark("thread_fwd")
if variant == "profile":
    pr = cProfile.Profile(); pr.enable(); fwd(); pr.disable(); mark("first_fwd")
else:
    fwd(); mark("first_fwd")
fwd(); mark("second_fwd")
print("RESULT", json.dumps({"variant": variant, "env": os.environ.get("CUDA_MODULE_LOADING"), "marks": m}), flush=True)
if variant == "profile":
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22); print(s.getvalue()[:6000])
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("cumtime").print_stats(25); print(s.getvalue()[:6000])
