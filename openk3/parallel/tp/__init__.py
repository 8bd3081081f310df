"""Tensor parallelism (docs/parallel.md): the attention trunk, the dense MLP, the shared experts and the vocabulary split
over T ranks, applied from outside the single-device model (shard.py), with the modules that add the collectives
(modules.py) and the start-up checks (layout.py)."""
