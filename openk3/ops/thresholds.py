"""Every tuned size switch of the CPU fast paths, in one place, each with the measurement that chose it. Values are for the
2-core dev VMs they were measured on (fp32, 2 threads): the earlier switches on an AMD EPYC Zen 4 VM (32 MiB L3), the
later ones (the panel rows, issue 42) on an Intel Xeon VM with AVX-512 and AMX (2 MiB L2 per core). A machine with other
caches may want other values: rerun the named benchmark before changing one.

The ops read them as their own module names (ops/linear.py, ops/moe/__init__.py, ops/attn_res/sized.py), so a test can move a
switch for one op with monkeypatch.
"""

# ops/linear.py -- benchmarks/ops_linear.py, benchmarks/results/ops_linear.md
KERNEL_ROWS = 16  # up to here the C few-row kernel, any weight size; at 32 rows it is no faster than the forms below
# With a panel copy of the weight (serving: ops/linear.py PackedWeight.panels) the C kernel's panel form goes further: on the
# demo model's 55 projections of a decode step (weights cycled, 1 thread, this box), against oneDNN's packed weights:
# 1.45x at 17 rows, 1.47x at 24, 1.33x at 32, 1.15x at 48, level at 64 (issue 42, perf3).
PANEL_ROWS = 48
LARGE_WEIGHT = 2**17  # below: F.linear (the other forms' extra per-call cost outweighs their faster streaming)
SMALL_ROWS = 8  # up to here the weight-first form; it gains 1.5-4x out of cache and loses from about 12 rows
PACKED_BATCH_HINT = 2048  # oneDNN picks the blocked layout for this row count; 16 and 2048 measured the same, 1 slower

# ops/moe/__init__.py moe_experts_sized -- benchmarks/ops_moe.py, benchmarks/results/ops_moe.md (E 16, k 2 and 4).
# The batched path pays for padding rows and a fixed ~25 ops; the grouped loop pays ~10 ops per active expert: from 16
# (token, expert) pairs up to 16 pairs per expert batched is 1.0-1.9x the grouped loop; at 32 pairs per expert it is 0.5x
# (padding then costs more than the loop's dispatch), and below 16 pairs the loop's few iterations are cheaper.
BATCHED_MIN_PAIRS = 16
BATCHED_MAX_PAIRS_PER_EXPERT = 16
# With the expert MLPs in C (ops/moe/cpu_pairs.py: no padding rows, one call for all experts) the batched path is 7-9x the
# grouped loop up to 16 tokens, ~3.5x the single-token path at one token, 1.4-3.4x from 4 to 64 pairs per expert, and 0.7x
# at 128-256 pairs per expert, where the loop's large per-expert GEMMs win.
# The same bound sends packed MXFP4 banks to their C loop (ops/moe/packed_c.py: these products with the weights decoded in
# registers): on the demo model's 16 experts of 128 x 128, 4-8x the decoded-bank path below at 1-16 tokens, 2.6x at 64,
# level at 256 (where re-decoding a weight for every 4 rows costs what one fp32 write of it saves); 9-21x at K3 widths.
C_LOOP_MAX_PAIRS_PER_EXPERT = 64
# Past that bound (prefill chunks) a packed MXFP4 bank takes the dense C loop when the experts a step picked, decoded at
# once, fit this many bytes (the demo model's 16 experts are 3 MiB in fp32); beyond it (one K3 expert is 132 MiB in fp32)
# it decodes expert by expert (grouped).
# Issue 42: the grouped loop's ~10 torch ops per expert were 70% of the demo model's batch-16 decode step.
PACKED_DECODE_MAX_BYTES = 64 << 20

# ops/attn_res/sized.py ("auto") -- benchmarks/attn_res.py, benchmarks/results/attn_res.md. Below this many tokens in a step the
# one-shot mix is kept: phase 1 costs a fixed ~12 + 4 x (stored blocks) small ops per block and a merge is not fewer ops
# than a one-shot mix, so decode-sized steps are op-count bound and the two-phase path is 0-4% slower there; it is level
# at 64 tokens and cheaper from 256 up, where reading and normalising the stored blocks dominates.
TWO_PHASE_MIN_TOKENS = 64

# ops/mla/blockwise.py mla_expanded_or_blockwise ("mla_prefill" "sized", what "auto" picks where the CPU flash latent form of
# ops/mla/latent_flash.py is not offered: GPUs, non-fp32 CPU). A memory bound, not a speed switch: past it the expanded
# K/V [s, H, Dn + Dr + Dv] and the [t, s] mask of one chunk would grow with the context, so key blocks take over.
MLA_EXPANDED_MAX_BYTES = 256 * 2**20
