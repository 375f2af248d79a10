import torch
allschemas = torch._C._jit_get_all_schemas()
sus = []; n_mut = 0
for s in allschemas:
    ns, _, nm = s.name.partition("::")
    base = nm
    has_write = any(a.alias_info is not None and a.alias_info.is_write for a in s.arguments)
    n_mut += has_write
    if base.endswith("_") and not base.startswith("_") or (base.endswith("_") and base.startswith("_") and not base.endswith("__")):
        if not has_write and any("Tensor" in str(a.type) for a in s.arguments):
            sus.append(f"{s.name}.{s.overload_name}" if s.overload_name else s.name)
print("total schemas", len(allschemas), "with a write arg", n_mut)
print("in-place-named (trailing _) ops with Tensor args but NO (a!) annotation:")
for x in sorted(set(sus)): print("  ", x)
