import torch, time, sys
from torch.utils._python_dispatch import TorchDispatchMode
from torch._dynamo.utils import counters
wrap = len(sys.argv) > 1
if wrap: torch._inductor.config.wrap_inductor_compiled_regions = True
class Quiet(TorchDispatchMode):
    supports_higher_order_operators = True
    def __init__(s): super().__init__(); s.ops=[]
    @classmethod
    def ignore_compile_internals(cls): return True
    def __torch_dispatch__(s, func, types, args=(), kwargs=None):
        name = str(func)
        if isinstance(func, torch._ops.HigherOrderOperator):
            inputs = args[1]
            name += f"(inputs={[tuple(t.shape) if isinstance(t, torch.Tensor) else t for t in inputs]}, kwargs={kwargs})"
        s.ops.append(name)
        return func(*args, **(kwargs or {}))
W = torch.randn(32, 32)
def f(x, buf):
    buf.add_(1)                  # mutation of an input
    return torch.mm((x * 2).sin(), W)
cf = torch.compile(f)
x = torch.randn(32, 32); buf = torch.zeros(4)
t0 = time.perf_counter(); cf(x, buf); print(f"compile+1st call: {time.perf_counter()-t0:.1f}s stats={dict(counters['stats'])}")
with Quiet() as m:
    t0 = time.perf_counter(); cf(x, buf); dt = time.perf_counter()-t0
print(f"under Quiet mode: {dt*1e3:.2f} ms; mode saw: {m.ops}; stats={dict(counters['stats'])}")
with Quiet() as m: cf(x, buf)
print(f"2nd under Quiet: saw {m.ops}")
print("buf after 3 calls:", buf)
def g(x): return (x + 3).cos()
cg = torch.compile(g)
with Quiet() as m: cg(x)
print(f"g first called under Quiet: saw {m.ops}; stats={dict(counters['stats'])}")
