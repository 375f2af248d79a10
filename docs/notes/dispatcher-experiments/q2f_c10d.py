import torch, torch.distributed as dist, os
from torch.utils._python_dispatch import TorchDispatchMode
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29555")
dist.init_process_group("gloo", rank=0, world_size=1)
class Log(TorchDispatchMode):
    def __init__(s): super().__init__(); s.ops=[]
    def __torch_dispatch__(s, func, types, args=(), kwargs=None):
        s.ops.append(str(func)); return func(*args, **(kwargs or {}))
t = torch.ones(4)
with Log() as m:
    dist.all_reduce(t); dist.broadcast(t, 0); w = dist.all_reduce(t, async_op=True); w.wait()
print("c10d ops seen:", m.ops)
import torch.distributed._functional_collectives as fc
with Log() as m:
    y = fc.all_reduce(t, "sum", dist.group.WORLD); y = y + 0
print("functional collectives seen:", m.ops)
for n in ["all_reduce_", "all_reduce", "wait_tensor"]:
    print(getattr(torch.ops._c10d_functional, n).default._schema)
dist.destroy_process_group()
