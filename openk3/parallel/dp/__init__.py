"""Data-parallel attention (docs/parallel.md): each DP rank runs an engine of its own (scheduler, cache pools, prefix
cache) over its own requests, the MoE layers exchange tokens across all ranks with expert parallelism, and rank 0 spreads
requests over the ranks (router.py) and steps them in lockstep (engine.py, channel.py, lockstep.py)."""
