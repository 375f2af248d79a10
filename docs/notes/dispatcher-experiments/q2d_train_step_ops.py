import torch, collections
from torch.utils._python_dispatch import TorchDispatchMode
class Log(TorchDispatchMode):
    def __init__(s): super().__init__(); s.ops=[]
    def __torch_dispatch__(s, func, types, args=(), kwargs=None):
        w = [a.name for a in func._schema.arguments if a.alias_info and a.alias_info.is_write]
        s.ops.append(str(func).replace("aten.","") + (f"[w:{','.join(w)}]" if w else ""))
        return func(*args, **(kwargs or {}))
model = torch.nn.Sequential(torch.nn.Linear(8,8), torch.nn.ReLU(), torch.nn.Linear(8,2))
opt = torch.optim.AdamW(model.parameters(), foreach=True)
x = torch.randn(4,8)
for _ in range(2):
    opt.zero_grad(); model(x).sum().backward(); opt.step()
with Log() as m:
    opt.zero_grad(); y = model(x).sum()
    fwd = len(m.ops); y.backward(); bwd = len(m.ops); opt.step()
print("FWD:", " ".join(m.ops[:fwd])); print("BWD:", " ".join(m.ops[fwd:bwd])); print("STEP:", " ".join(m.ops[bwd:]))
# set_to_none=False path
with Log() as m: opt.zero_grad(set_to_none=False)
print("zero_grad(set_to_none=False):", m.ops)
with Log() as m: model(x).sum().backward()
print("BWD with existing grads:", [o for o in m.ops if 'w:' in o])
