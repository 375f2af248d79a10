import torch, threading
from torch.utils._python_dispatch import TorchDispatchMode
class Log(TorchDispatchMode):
    def __init__(s): super().__init__(); s.ops=[]
    def __torch_dispatch__(s, func, types, args=(), kwargs=None):
        s.ops.append((threading.get_ident() == MAIN, str(func)))
        out = func(*args, **(kwargs or {}))
        torch.ones(1).add_(1)   # op issued inside the handler: re-intercepted?
        return out
MAIN = threading.get_ident()
def work(x): return x * 3
with Log() as m:
    fut = torch.jit.fork(work, torch.ones(2)); torch.jit.wait(fut)
print("jit.fork (eager python fn) ops [(on_main_thread, op)]:", m.ops)
# a thread that explicitly pushes the same mode object
m2 = Log()
def worker():
    with m2: torch.ones(2).mul_(2)
t = threading.Thread(target=worker); t.start(); t.join()
print("mode entered inside worker thread sees its ops:", m2.ops)
# low-level push/pop API, per thread
m3 = Log()
torch._C._push_on_torch_dispatch_stack(m3)
torch.zeros(1).sub_(1)
popped = torch._C._pop_torch_dispatch_stack(None)
print("_push_on_torch_dispatch_stack:", m3.ops, "popped is m3:", popped is m3)
