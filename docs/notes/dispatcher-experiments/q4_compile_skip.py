import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch._dynamo.utils import counters
class Log(TorchDispatchMode):
    def __init__(s): super().__init__(); s.ops=[]
    def __torch_dispatch__(s, func, types, args=(), kwargs=None):
        s.ops.append(str(func).replace("aten.",""))
        return func(*args, **(kwargs or {}))
calls = {"compiles": 0, "graph_runs": 0}
def backend(gm, example_inputs):
    calls["compiles"] += 1
    def run(*a):
        calls["graph_runs"] += 1
        return gm.forward(*a)
    return run
def f(x): return (x * 2).sin()
def g(x): return (x + 1).cos()
cf = torch.compile(f, backend=backend); cg = torch.compile(g, backend=backend)
x = torch.randn(8)
def st(label, m=None): print(f"{label:55s} {calls} ops={m.ops if m else '-'}")
cf(x); st("f: call 1, no mode")
with Log() as m: cf(x)
st("f: call under mode", m)
cf(x); st("f: call after mode")
with Log() as m: cf(torch.randn(3, 5))
st("f: call under mode, NEW shape (would recompile)", m)
cf(torch.randn(3, 5)); st("f: new shape, no mode")
cf(torch.randn(7, 5)); st("f: another shape, no mode")
cf(x); st("f: old shape, no mode")
with Log() as m: cg(x)
st("g: FIRST call under mode", m)
cg(x); cg(x); st("g: 2 calls after mode")
torch._dynamo.reset(); cg(x); st("g: after torch._dynamo.reset()")
class Quiet(Log):
    @classmethod
    def ignore_compile_internals(cls): return True
def h(x): return (x - 1).tan()
ch = torch.compile(h, backend=backend)
with Quiet() as m: ch(x)
st("h: first call under mode with ignore_compile_internals=True", m)
with Quiet() as m: ch(x)
st("h: 2nd call under that mode", m)
ch(x); st("h: no mode")
