import torch
A = torch.ops.aten
ops = [A.copy_.default, A.index_put_.default, A.set_.source_Storage_storage_offset, A.set_.source_Tensor, A.set_.default,
       A.resize_.default, A.resize_as_.default, A.detach_.default, A.as_strided_.default, A.transpose_.default, A.t_.default,
       A.squeeze_.dim, A.unsqueeze_.default, A.swapdims_.default,
       A._foreach_add_.List, A._foreach_mul_.Scalar, A._fused_adamw_.default, A._fused_sgd_.default,
       A.add.out, A.mm.out, A.sum.IntList_out, A.max.dim_max, A.sort.values, A.view.default, A.transpose.int, A.split.Tensor,
       A.zero_.default, A.fill_.Scalar, A.normal_.default, A.uniform_.default, A.bernoulli_.float, A.random_.default, A.exponential_.default,
       A._amp_foreach_non_finite_check_and_unscale_.default, A._amp_update_scale_.default, A.record_stream.default,
       A.native_batch_norm.default, A._native_batch_norm_legit.default, A._native_batch_norm_legit_functional.default, A.embedding_dense_backward.default,
       A.split_with_sizes_copy.out, A._foreach_copy_.default, A.lift_fresh.default, A.alias.default, A.rrelu_with_noise.default, A._index_put_impl_.default,
       A.index_copy_.default, A.scatter_.src, A.masked_fill_.Scalar, A.put_.default, A.nonzero.default, A._local_scalar_dense.default, A.resize_as_sparse_.default,
       A._cudnn_rnn.default, A.cudnn_batch_norm.default, A.set_data.default, A._coalesce.default, A.unbind.int, A.chunk.default]
for op in ops:
    s = op._schema
    w = [a.name for a in s.arguments if a.alias_info and a.alias_info.is_write]
    kw = [a.name for a in s.arguments if a.kwarg_only and a.alias_info and a.alias_info.is_write]
    rets = [(r.alias_info.before_set if r.alias_info else None, r.alias_info.is_write if r.alias_info else None) for r in s.returns]
    tags = [str(t).split('.')[-1] for t in op.tags]
    print(f"{str(op):50s} writes={w} kwonly_writes={kw} is_mutable={s.is_mutable} tags={tags}\n      {s}")
