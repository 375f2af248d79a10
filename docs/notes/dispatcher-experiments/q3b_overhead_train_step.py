import torch, time
from torch.utils._python_dispatch import TorchDispatchMode
torch.set_num_threads(1)
_c = {}
def widx(func):
    r = _c.get(func)
    if r is None:
        r = _c[func] = tuple((i, a.name, a.kwarg_only) for i, a in enumerate(func._schema.arguments) if a.alias_info is not None and a.alias_info.is_write)
    return r
T = torch.Tensor
class Tracker(TorchDispatchMode):
    def __init__(s): super().__init__(); s.n = 0; s.written = set()
    @classmethod
    def ignore_compile_internals(cls): return True
    def __torch_dispatch__(s, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        s.n += 1
        for i, name, kw in widx(func):
            v = kwargs.get(name) if (kw or i >= len(args)) else args[i]
            if isinstance(v, T): s.written.add(v.untyped_storage()._cdata)
            elif isinstance(v, (list, tuple)):
                for t in v:
                    if isinstance(t, T): s.written.add(t.untyped_storage()._cdata)
        return func(*args, **kwargs)
model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64), torch.nn.GELU()) for _ in range(8)], torch.nn.Linear(64, 1))
opt = torch.optim.AdamW(model.parameters(), foreach=True)
x = torch.randn(16, 64)
def step():
    opt.zero_grad(); model(x).sum().backward(); opt.step()
for _ in range(5): step()
def timeit(n=50):
    best = 1e9
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n): step()
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e3
base = timeit()
tr = Tracker(); tr.__enter__(); step(); n_ops = tr.n; w = timeit(); tr.__exit__(None, None, None)
print(f"train step (8x Linear64+LN+GELU, AdamW foreach, CPU): {base:.2f} ms no mode, {w:.2f} ms under tracker; {n_ops} aten ops/step -> {(w-base)/n_ops*1e3:.1f} us/op overhead; storages written in window: {len(tr.written)}")
