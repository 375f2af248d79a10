import torch
from torch.utils._python_dispatch import TorchDispatchMode
class Log(TorchDispatchMode):
    def __init__(s): super().__init__(); s.ops=[]
    def __torch_dispatch__(s, func, types, args=(), kwargs=None):
        s.ops.append(str(func)); return func(*args, **(kwargs or {}))
def show(label, fn):
    m=Log()
    with m: fn()
    print(f"{label:45s} -> {m.ops}")
t = torch.randn(16)
show("t.untyped_storage().resize_(0)", lambda: t.untyped_storage().resize_(0))
t = torch.randn(16); s = t.untyped_storage()
show("storage.fill_(0)", lambda: s.fill_(0))
show("storage.copy_(other storage)", lambda: s.copy_(torch.ones(16).untyped_storage()))
show("torch.utils.dlpack.to_dlpack/from_dlpack", lambda: torch.utils.dlpack.from_dlpack(t.__dlpack__()))
show("t.__dlpack__()", lambda: t.__dlpack__())
show("torch.from_dlpack(t) then .add_", lambda: torch.from_dlpack(t).add_(1))
show("memoryview write via numpy", lambda: t.numpy().__setitem__(0, 5))
show("torch.frombuffer(bytearray)", lambda: torch.frombuffer(bytearray(16), dtype=torch.float32))
