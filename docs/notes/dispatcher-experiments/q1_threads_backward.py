import torch, threading
from torch.utils._python_dispatch import TorchDispatchMode
class Log(TorchDispatchMode):
    def __init__(s): super().__init__(); s.ops=[]
    def __torch_dispatch__(s, func, types, args=(), kwargs=None):
        s.ops.append((threading.current_thread().name, str(func)))
        return func(*args, **(kwargs or {}))
x = torch.randn(4,4, requires_grad=True)
m = Log()
with m:
    y = (x*2).sin().sum()
    y.backward()
print("ops:", m.ops)
# backward outside the window for graph built inside? and vice versa
m2 = Log()
y = (x*2).sin().sum()
with m2:
    y.backward()
print("backward only under mode:", m2.ops)
# other Python threads
m3 = Log()
out=[]
def worker():
    out.append(torch.ones(3)+1)
with m3:
    t = threading.Thread(target=worker, name="bg"); t.start(); t.join()
    torch.ones(2).add_(1)
print("thread test:", m3.ops)
print("mode stack len in thread:", end=" ")
def w2():
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    print(len(_get_current_dispatch_mode_stack()))
with Log():
    t=threading.Thread(target=w2); t.start(); t.join()
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    print("main:", len(_get_current_dispatch_mode_stack()))
