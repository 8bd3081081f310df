"""Expert parallelism: the MoE layer's routed experts spread over ranks (docs/parallel.md). `backend.attach_expert_parallel` is
the entry; `exchange` moves rows, `static_backend` (plain EP, EPLB placement) and `moonep_backend` (per-step balanced plans
with expert prefetch) drive it, `placement`, `moonep` and `shard` are their math and storage."""
