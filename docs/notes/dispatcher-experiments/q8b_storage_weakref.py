import torch, weakref, gc
x = torch.randn(4)
w = weakref.ref(x.untyped_storage()); gc.collect()
print("weakref alive while tensor alive:", w() is not None, "| same obj on re-fetch:", w() is x.untyped_storage())
v = x[1:]; del x; gc.collect()
print("after del base (view alive):", w() is not None)
del v; gc.collect()
print("after del view too:", w() is None)
fired = []
x = torch.randn(4); cd = x.untyped_storage()._cdata
weakref.finalize(x.untyped_storage(), lambda: fired.append(cd))
del x; gc.collect(); print("weakref.finalize on storage fired at free:", fired == [cd])
