import torch, collections
from torch.utils._python_dispatch import TorchDispatchMode
def written(func):
    s = func._schema
    w = []
    for i,a in enumerate(s.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            w.append((a.name, str(a.type), "kwarg_only" if a.kwarg_only else "pos"))
    return w
class Log(TorchDispatchMode):
    def __init__(s): super().__init__(); s.ops=collections.Counter()
    def __torch_dispatch__(s, func, types, args=(), kwargs=None):
        s.ops[(str(func), tuple(written(func)))]+=1
        return func(*args, **(kwargs or {}))
torch.manual_seed(0)
for name, mk in [("AdamW foreach=None(default)", lambda p: torch.optim.AdamW(p)),
                 ("AdamW foreach=True", lambda p: torch.optim.AdamW(p, foreach=True)),
                 ("AdamW foreach=False", lambda p: torch.optim.AdamW(p, foreach=False)),
                 ("AdamW fused=True", lambda p: torch.optim.AdamW(p, fused=True)),
                 ("SGD momentum default", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
                 ("Adam foreach=True", lambda p: torch.optim.Adam(p, foreach=True))]:
    model = torch.nn.Sequential(torch.nn.Linear(8,8), torch.nn.ReLU(), torch.nn.Linear(8,2))
    opt = mk(model.parameters())
    def step():
        opt.zero_grad()
        model(torch.randn(4,8)).sum().backward()
        opt.step()
    step()  # warm: state init outside the mode
    m = Log()
    with m:
        opt.step()
    print(f"== {name}: opt.step() ops (2nd step)")
    for (op,w),n in m.ops.items(): print(f"   {n:3d} x {op}  writes={list(w)}")
