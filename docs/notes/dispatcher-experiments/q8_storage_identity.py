import torch, weakref, gc
t = torch.randn(1000)
s1 = t.untyped_storage(); s2 = t.untyped_storage()
print("two calls: same _cdata", s1._cdata == s2._cdata, "| same python object", s1 is s2)
v = t[10:20].view(2,5).t()
print("view shares _cdata:", v.untyped_storage()._cdata == t.untyped_storage()._cdata, "| _storage_id:", torch._C._storage_id(v) == torch._C._storage_id(t))
d = t.detach(); print("detach shares:", d.untyped_storage()._cdata == s1._cdata)
# resize_ grow: same StorageImpl, new data ptr?
c0, p0 = t.untyped_storage()._cdata, t.untyped_storage().data_ptr()
t.resize_(10**6)
print("after resize_ grow: same _cdata", t.untyped_storage()._cdata == c0, "| same data_ptr", t.untyped_storage().data_ptr() == p0, "| old storage obj nbytes", s1.nbytes())
# set_ onto another tensor's storage
u = torch.zeros(5)
t.set_(u)
print("after t.set_(u): t shares u's storage", t.untyped_storage()._cdata == u.untyped_storage()._cdata, "| old storage kept alive by s1:", s1.nbytes())
# p.data = ...
p = torch.nn.Parameter(torch.randn(3)); c = p.untyped_storage()._cdata
p.data = torch.zeros(3); print("after p.data = new: same _cdata", p.untyped_storage()._cdata == c)
# weakref to storage?
try:
    w = weakref.ref(t.untyped_storage()); print("weakref to UntypedStorage OK, alive:", w() is not None)
except TypeError as e: print("weakref(UntypedStorage) ->", e)
try:
    w = weakref.ref(t); print("weakref to Tensor OK")
except TypeError as e: print("weakref(Tensor) ->", e)
# does the python storage object keep the StorageImpl alive?
x = torch.randn(256); st = x.untyped_storage(); cd = st._cdata; del x; gc.collect()
print("storage obj alive after tensor del:", st._cdata == cd, st.nbytes())
# address reuse after free
seen = set(); reused = 0
for i in range(200):
    y = torch.empty(1024)
    cd = y.untyped_storage()._cdata
    if cd in seen: reused += 1
    seen.add(cd); del y
print(f"_cdata reused across 200 free/alloc cycles: {reused} times (distinct values {len(seen)})")
# python-level storage object identity across calls / weakref lifetime
x = torch.randn(4)
w = weakref.ref(x.untyped_storage()); gc.collect()
print("weakref to a temporary x.untyped_storage() dies immediately:", w() is None)
# use_count
print("_storage_Use_Count doc:", torch._C._storage_Use_Count.__doc__)
x = torch.randn(4); print("use_count x:", torch._C._storage_Use_Count(x.untyped_storage()._cdata)); v = x.view(2,2); print("after view:", torch._C._storage_Use_Count(x.untyped_storage()._cdata))
# tensor._cdata
print("tensor _cdata vs view _cdata differ:", x._cdata != v._cdata)
