import torch, threading
from torch.utils._python_dispatch import TorchDispatchMode
torch._inductor.config.wrap_inductor_compiled_regions = True
class Quiet(TorchDispatchMode):
    supports_higher_order_operators = True
    @classmethod
    def ignore_compile_internals(cls): return True
    def __torch_dispatch__(s, func, types, args=(), kwargs=None): return func(*args, **(kwargs or {}))
def f(x): return (x * 2).sin()
cf = torch.compile(f)
x = torch.randn(8); cf(x)
res = {}
def other():
    try: res['out'] = cf(x).sum().item()
    except Exception as e: res['err'] = repr(e)[:200]
with Quiet():
    t = threading.Thread(target=other); t.start(); t.join()
print("other thread, wrap=True, mode only on main:", res)
