"""GPU-side checks for docs/notes/dispatcher-research.md (NOT YET RUN on a GPU).

Run on the device machine (torch 2.11+cu130, triton 3.6):  python3 docs/notes/dispatcher_gpu_checks.py
Each check prints one line; compare with the "expected (from source)" claims in the notes.
Research scaffolding only: not library code, not a test.
"""
import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class Log(TorchDispatchMode):
    supports_higher_order_operators = True

    def __init__(self):
        super().__init__()
        self.ops = []

    @classmethod
    def ignore_compile_internals(cls):
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append((threading.current_thread().name, str(func)))
        return func(*args, **(kwargs or {}))


def main():
    assert torch.cuda.is_available()
    dev = "cuda"
    print("torch", torch.__version__)

    # 1. backward on CUDA runs on the autograd device thread; TLS (mode stack) is propagated
    x = torch.randn(64, 64, device=dev, requires_grad=True)
    with Log() as m:
        (x * 2).sin().sum().backward()
    print("1 backward threads:", sorted({t for t, _ in m.ops}), "n_ops", len(m.ops))

    # 2. BatchNorm2d on CUDA: which op carries the running-stat writes
    bn = torch.nn.BatchNorm2d(8).to(dev)
    with Log() as m:
        bn(torch.randn(4, 8, 5, 5, device=dev))
    print("2 batchnorm ops:", [o for _, o in m.ops])

    # 3. AdamW default (foreach) on CUDA
    lin = torch.nn.Linear(16, 16).to(dev)
    opt = torch.optim.AdamW(lin.parameters())
    lin(torch.randn(2, 16, device=dev)).sum().backward()
    opt.step()
    with Log() as m:
        opt.step()
    print("3 adamw default ops:", sorted({o for _, o in m.ops}))

    # 4. CUDAGraph.replay: patched at class level; the mode sees nothing of the replay
    replays = []
    orig_replay = torch.cuda.CUDAGraph.replay

    def replay(self):
        replays.append(id(self))
        return orig_replay(self)

    torch.cuda.CUDAGraph.replay = replay
    try:
        s = torch.randn(1024, device=dev)
        g = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            s.add_(1)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(g):
            s.mul_(2)
        with Log() as m:
            g.replay()
        print("4 replay hook calls", len(replays), "mode saw", m.ops)

        # 5. make_graphed_callables + reduce-overhead go through the same method
        n0 = len(replays)
        mod = torch.nn.Linear(32, 32).to(dev)
        gm = torch.cuda.make_graphed_callables(mod, (torch.randn(4, 32, device=dev, requires_grad=True),))
        gm(torch.randn(4, 32, device=dev, requires_grad=True)).sum().backward()
        print("5a make_graphed_callables replays:", len(replays) - n0)
        n0 = len(replays)
        f = torch.compile(lambda a: (a * 2).sin() + 1, mode="reduce-overhead")
        for _ in range(4):
            f(torch.randn(256, device=dev))
        print("5b reduce-overhead replays:", len(replays) - n0)
    finally:
        torch.cuda.CUDAGraph.replay = orig_replay

    # 6. Triton: knobs launch hook vs CachingAutotuner.run vs JITFunction.run
    import triton
    import triton.language as tl
    from triton import knobs
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    hook_calls, cat_calls, jit_calls = [], [], []

    def enter_hook(meta):
        hook_calls.append(meta.get()["name"] if hasattr(meta, "get") else str(meta))

    orig_cat = CachingAutotuner.run

    def cat_run(self, *args, **kwargs):
        names = list(self.triton_meta.get("signature", {}).keys())
        cat_calls.append((self.fn.__name__, names[: len(args)], list(self.mutated_arg_names)))
        return orig_cat(self, *args, **kwargs)

    orig_jit = triton.runtime.jit.JITFunction.run

    def jit_run(self, *args, grid, warmup, **kwargs):
        if not warmup:
            jit_calls.append((self.fn.__name__, [type(a).__name__ for a in args]))
        return orig_jit(self, *args, grid=grid, warmup=warmup, **kwargs)

    knobs.runtime.launch_enter_hook.add(enter_hook)
    CachingAutotuner.run = cat_run
    triton.runtime.jit.JITFunction.run = jit_run
    try:
        @torch.compile
        def h(a, buf):
            buf.add_(1)
            return (a * 3).cos()

        h(torch.randn(1000, device=dev), torch.zeros(10, device=dev))

        @triton.jit
        def k(p, n, B: tl.constexpr):
            i = tl.program_id(0) * B + tl.arange(0, B)
            tl.store(p + i, tl.load(p + i, mask=i < n) + 1, mask=i < n)

        t = torch.zeros(100, device=dev)
        k[(1,)](t, 100, B=128)
        torch.cuda.synchronize()
        print("6 launch_enter_hook calls:", hook_calls)
        print("6 CachingAutotuner.run calls:", cat_calls)
        print("6 JITFunction.run calls:", jit_calls)
        print("6 use_static_cuda_launcher:", torch._inductor.config.use_static_cuda_launcher)
    finally:
        knobs.runtime.launch_enter_hook.remove(enter_hook)
        CachingAutotuner.run = orig_cat
        triton.runtime.jit.JITFunction.run = orig_jit


if __name__ == "__main__":
    main()
