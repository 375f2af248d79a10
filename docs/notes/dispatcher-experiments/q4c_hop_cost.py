import torch, time
from torch.utils._python_dispatch import TorchDispatchMode
torch._inductor.config.wrap_inductor_compiled_regions = True
torch.set_num_threads(1)
class Quiet(TorchDispatchMode):
    def __init__(s): super().__init__(); s.ops=[]
    @classmethod
    def ignore_compile_internals(cls): return True
    def __torch_dispatch__(s, func, types, args=(), kwargs=None):
        s.ops.append(str(func))
        return func(*args, **(kwargs or {}))
class Empty(TorchDispatchMode):
    supports_higher_order_operators = True
    @classmethod
    def ignore_compile_internals(cls): return True
    def __torch_dispatch__(s, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))
def f(x, buf):
    buf.add_(1)
    return (x * 2).sin()
cf = torch.compile(f)
x = torch.randn(64); buf = torch.zeros(4)
cf(x, buf)
try:
    with Quiet() as m: cf(x, buf)
    print("supports_higher_order_operators=False (default): saw", m.ops)
except Exception as e:
    print("supports_higher_order_operators=False (default) ->", type(e).__name__, str(e)[:300])
def timeit(fn, n=3000):
    for _ in range(100): fn()
    best = 1e9
    for _ in range(5):
        t0=time.perf_counter()
        for _ in range(n): fn()
        best = min(best, (time.perf_counter()-t0)/n*1e6)
    return best
print(f"compiled, no mode: {timeit(lambda: cf(x, buf)):.1f} us")
e = Empty(); e.__enter__()
print(f"compiled, Empty(ignore_compile_internals) mode: {timeit(lambda: cf(x, buf)):.1f} us")
e.__exit__(None, None, None)
