import torch, time
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils import _pytree as pytree
torch.set_num_threads(1)
_cache = {}
def write_idx(func):
    r = _cache.get(func)
    if r is None:
        r = tuple((i, a.name, a.kwarg_only) for i, a in enumerate(func._schema.arguments)
                  if a.alias_info is not None and a.alias_info.is_write)
        _cache[func] = r
    return r
T = torch.Tensor
class WritesOnly(TorchDispatchMode):
    def __torch_dispatch__(s, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        w = []
        for i, name, kwonly in write_idx(func):
            v = kwargs.get(name) if (kwonly or i >= len(args)) else args[i]
            if isinstance(v, T): w.append(v.untyped_storage()._cdata)
            elif isinstance(v, (list, tuple)):
                for t in v:
                    if isinstance(t, T): w.append(t.untyped_storage()._cdata)
        return func(*args, **kwargs)
class WritesSkipPure(TorchDispatchMode):
    """only inspect ops that have a write arg at all (func -> () cached)"""
    def __torch_dispatch__(s, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        wi = _cache.get(func)
        if wi is None: wi = write_idx(func)
        if wi:
            for i, name, kwonly in wi:
                v = kwargs.get(name) if (kwonly or i >= len(args)) else args[i]
                if isinstance(v, T): v.untyped_storage()._cdata
        return func(*args, **kwargs)
class ReadsPytree(TorchDispatchMode):
    def __torch_dispatch__(s, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        r = [t.untyped_storage()._cdata for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, T)]
        return func(*args, **kwargs)
class ReadsFlat(TorchDispatchMode):
    def __torch_dispatch__(s, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        r = []
        for v in args:
            if isinstance(v, T): r.append(v.untyped_storage()._cdata)
            elif isinstance(v, (list, tuple)):
                for t in v:
                    if isinstance(t, T): r.append(t.untyped_storage()._cdata)
        for v in kwargs.values():
            if isinstance(v, T): r.append(v.untyped_storage()._cdata)
        return func(*args, **kwargs)
a = torch.randn(16); b = torch.randn(16)
N = 200000
def bench(mode, fn, n=N):
    return min(_bench(mode, fn, n//4) for _ in range(5))
def _bench(mode, fn, n=N):
    for _ in range(2000): fn()
    if mode: mode.__enter__()
    t0 = time.perf_counter()
    for _ in range(n): fn()
    dt = time.perf_counter() - t0
    if mode: mode.__exit__(None, None, None)
    return dt/n*1e6
for opname, fn in [("a.add_(b)", lambda: a.add_(b)), ("torch.add(a,b)", lambda: torch.add(a, b)),
                   ("_foreach_add_(8 tensors)", lambda: torch._foreach_add_([a]*8, [b]*8))]:
    res = {k: bench(m, fn) for k, m in [("none", None), ("writes-only", WritesOnly()), ("writes-skip-pure", WritesSkipPure()), ("reads-pytree", ReadsPytree()), ("reads-flat", ReadsFlat())]}
    print(opname, "  ".join(f"{k}={v:.2f}us" for k, v in res.items()))
