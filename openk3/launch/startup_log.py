"""The start-up lines of `openk3 serve`, once the engine is built: what an operator checks first when a server misbehaves
(which model, how long a context, how much cache in pages, tokens and KDA state slots, which dtype and device, which
parallel layout, which address), in the log instead of behind a request."""

from __future__ import annotations

import logging

from openk3.parallel.config import ParallelConfig
from openk3.serve.engine_api import ServedEngine

log = logging.getLogger("openk3.api")


def startup_lines(engine: ServedEngine, served_name: str, model_source: str, parallel: ParallelConfig, host: str, port: int) -> list[str]:
    c, cache = engine.config, engine.cache
    engines = engine.num_engines
    pages, slots = cache.num_pages, cache.state_pool.num_slots
    tensors = [*cache.tensors.mla_latent, *cache.tensors.kda_state]
    cache_dtype = str(tensors[0].dtype).removeprefix("torch.") if tensors else c.dtype
    layers = engine.model_config
    each = " each" if engines > 1 else ""
    prefix = f"on (match unit {c.prefix_match_unit} tokens)" if c.enable_prefix_caching else "off"
    tiers = [f"{name} {size / 2**20:.0f} MiB" for name, size in (("host", c.cpu_offload_bytes), ("disk", c.disk_offload_bytes)) if size]
    return [
        f"model {served_name!r} from {model_source}: {layers.num_hidden_layers} layers ({len(layers.mla_layers)} MLA, "
        f"{layers.num_hidden_layers - len(layers.mla_layers)} KDA), vocabulary {layers.vocab_size}; weights {c.dtype} on {c.device}",
        f"context length (max_model_len) {engine.max_model_len} tokens; at most {c.max_num_seqs} running requests and "
        f"{c.max_num_batched_tokens} tokens per step",
        f"cache{each}: {pages} MLA pages x {cache.page_size} tokens = {pages * cache.page_size} tokens, {slots} KDA state slots, "
        f"{c.cache_memory_bytes / 2**20:.0f} MiB budget, dtype {cache_dtype}; prefix caching {prefix}"
        + (f"; offload tiers: {', '.join(tiers)}" if tiers else ""),
        f"parallel layout: tp={parallel.tp} ep={parallel.ep} dp={parallel.dp} ({parallel.world_size} rank{'s' if parallel.world_size > 1 else ''}"
        + (f", ep method {parallel.ep_method}" if parallel.ep > 1 else "")
        + (f", cp={parallel.cp}: prefill steps of >= {parallel.cp_min_tokens} new tokens split by position, KDA {parallel.kda_cp}" if parallel.cp > 1 else "")
        + (f", decode CP: each rank holds 1/{parallel.cp} of every MLA page" if parallel.decode_cp else "")
        + f"; {engines} engine{'s' if engines > 1 else ''})",
        f"serving on http://{host}:{port}",
    ]


def log_startup(engine: ServedEngine, served_name: str, model_source: str, parallel: ParallelConfig, host: str, port: int) -> None:
    for line in startup_lines(engine, served_name, model_source, parallel, host, port):
        log.info("%s", line)
