import torch, threading
from torch.utils._python_dispatch import TorchDispatchMode
class Log(TorchDispatchMode):
    def __torch_dispatch__(s, func, types, args=(), kwargs=None): return func(*args, **(kwargs or {}))
class Quiet(Log):
    @classmethod
    def ignore_compile_internals(cls): return True
calls = {"compiles": 0, "graph_runs": 0}
def backend(gm, ex):
    calls["compiles"] += 1
    def run(*a): calls["graph_runs"] += 1; return gm.forward(*a)
    return run
for M in (Log, Quiet):
    def f(x): return (x * 2).sin()
    cf = torch.compile(f, backend=backend)
    x = torch.randn(8); cf(x)
    before = dict(calls)
    with M():   # mode on MAIN thread only
        t = threading.Thread(target=lambda: cf(x)); t.start(); t.join()
    t = threading.Thread(target=lambda: cf(x)); t.start(); t.join()
    cf(x)
    print(f"{M.__name__}: main-thread mode, other thread calls compiled fn: before={before} after={calls}")
