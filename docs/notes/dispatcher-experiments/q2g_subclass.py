import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.testing._internal.two_tensor import TwoTensor
class Log(TorchDispatchMode):
    def __init__(s): super().__init__(); s.ops=[]
    def __torch_dispatch__(s, func, types, args=(), kwargs=None):
        info = []
        for a in args:
            if isinstance(a, torch.Tensor):
                try: st = a.untyped_storage(); info.append(f"{type(a).__name__}:storage nbytes={st.nbytes()}")
                except Exception as e: info.append(f"{type(a).__name__}:untyped_storage() -> {type(e).__name__}: {str(e)[:60]}")
                if is_traceable_wrapper_subclass(a):
                    attrs, _ = a.__tensor_flatten__(); info.append(f"inner={attrs}")
        s.ops.append((str(func), types, info))
        return func(*args, **(kwargs or {}))
a = TwoTensor(torch.zeros(3), torch.zeros(3))
with Log() as m:
    a.add_(1)
for o in m.ops: print(o)
print("inner tensors written:", a.a, a.b)
