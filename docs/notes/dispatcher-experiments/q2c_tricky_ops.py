import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch._C import _SchemaInfo as SchemaInfo, _SchemaArgument as SchemaArgument, _SchemaArgType as SchemaArgType
class Log(TorchDispatchMode):
    def __init__(s): super().__init__(); s.ops=[]
    def __torch_dispatch__(s, func, types, args=(), kwargs=None):
        s.ops.append(str(func))
        return func(*args, **(kwargs or {}))
def show(label, fn):
    m=Log()
    with m: fn()
    print(f"{label:40s} -> {m.ops}")
bn = torch.nn.BatchNorm1d(4); x = torch.randn(8,4)
show("BatchNorm1d train fwd", lambda: bn(x))
bn.eval(); show("BatchNorm1d eval fwd", lambda: bn(x)); bn.train()
p = torch.nn.Parameter(torch.randn(3))
def f1(): p.data = torch.zeros(3)
show("p.data = t", f1)
show("p.data.copy_(t)", lambda: p.data.copy_(torch.ones(3)))
def f3():
    with torch.no_grad(): p.copy_(torch.ones(3)); p.mul_(2)
show("no_grad: p.copy_, p.mul_", f3)
show("p.detach().zero_()", lambda: p.detach().zero_())
t = torch.zeros(4)
show("t.set_(other)", lambda: t.set_(torch.ones(2)))
show("t.resize_(100)", lambda: t.resize_(100))
show("t[1:3] = 5", lambda: t.__setitem__(slice(1,3), 5))
show("t[idx] = v", lambda: t.__setitem__(torch.tensor([0,2]), torch.tensor(7.)))
show("torch.add(a,b,out=t)", lambda: torch.add(torch.ones(2), torch.ones(2), out=t))
show("x.numpy()[0]=1 (no dispatch)", lambda: t.numpy().__setitem__(0, 1.0))
show("t.view(2,-1).add_(1)", lambda: t.view(2,-1).add_(1))
show("dropout train", lambda: torch.nn.functional.dropout(x, 0.5, True))
show("torch.randn (RNG)", lambda: torch.randn(3))
g = torch.Generator()
show("gen.manual_seed / get_state", lambda: (torch.manual_seed(0), torch.get_rng_state()))
show("torch.save-ish: t.clone()", lambda: t.clone())
show("t.untyped_storage()", lambda: t.untyped_storage())
show("t.data_ptr(); t.tolist()", lambda: (t.data_ptr(), t.tolist()))
# SchemaInfo
op = torch.ops.aten.native_batch_norm.default
si = SchemaInfo(op._schema)
rm = torch.zeros(4)
si.add_argument_values({"input": x, "weight": None, "bias": None, "running_mean": rm, "running_var": torch.ones(4), "training": True, "momentum": 0.1, "eps": 1e-5})
print("SchemaInfo native_batch_norm training=True is_mutable(running_mean):", si.is_mutable(SchemaArgument(SchemaArgType.input, 3)))
si2 = SchemaInfo(op._schema)
si2.add_argument_values({"training": False})
print("SchemaInfo native_batch_norm training=False is_mutable(running_mean):", si2.is_mutable(SchemaArgument(SchemaArgType.input, 3)))
print("plain schema is_mutable for running_mean:", op._schema.arguments[3].alias_info)
