"""How an LLMEngine's cache and speculative draft are built from its config (serve/engine.py calls these once).

The cache: pages sized to the cache memory after the slots every running sequence, every prefix snapshot and every
verified draft position need (a speculating engine keeps the KDA state after each of k positions: serve/spec_states.py),
and the prefix cache's settings with the salt that keys them to these weights and this cache format. The draft: at most
one of a draft model, an MTP layer and an EAGLE-3 head, each refused by name where the engine cannot run it.
"""

from __future__ import annotations

import torch

from openk3.config import ModelConfig
from openk3.model.eagle3_mla import AnyEagle3Head
from openk3.model.model import K3ForCausalLM
from openk3.model.mtp import MTPLayer
from openk3.serve.cache.hashing import model_salt
from openk3.serve.cache.manager import CacheManager, cache_spec
from openk3.serve.cache.prefix import PrefixCacheConfig
from openk3.serve.config import EngineConfig
from openk3.serve.draft import DraftProposer
from openk3.serve.eagle3_draft import Eagle3Proposer
from openk3.serve.mtp_draft import MTPProposer
from openk3.serve.runner import CausalLM, ModelRunner

Proposer = DraftProposer | MTPProposer | Eagle3Proposer


def check_drafts(cfg: EngineConfig, draft_model: CausalLM | None, mtp_layer: MTPLayer | None, eagle3_head: AnyEagle3Head | None) -> bool:
    """Whether the engine speculates; raises for what it cannot (more than one draft, drafts with CUDA graphs)."""
    drafts = [d for d in (draft_model, mtp_layer, eagle3_head) if d is not None]
    if len(drafts) > 1:
        raise ValueError("more than one of a draft model, an MTP layer and an EAGLE-3 head were given: speculative decoding takes one draft")
    if drafts and cfg.cuda_graphs:
        raise ValueError("speculative decoding with EngineConfig.cuda_graphs=True is not supported yet (issue 39)")
    return bool(drafts)


def build_cache(
    model: CausalLM, cfg: EngineConfig, cache_dtype: torch.dtype, device: torch.device, spec_k: int, latent_shards: int
) -> tuple[CacheManager, int]:
    """The engine's CacheManager and its number of pages (the scratch pages of CUDA graphs not counted). `spec_k`: draft
    tokens per step (0 without a draft); `latent_shards` > 1: this process holds its share of every MLA page (decode
    context parallelism), so the cache memory holds that many times the pages."""
    config: ModelConfig = model.config
    snapshot_slots = cfg.snapshot_slots(cache_spec(config, cfg.page_size, cache_dtype, cfg.fp8_latent).kda.bytes_per_sequence)
    verify_slots = cfg.max_num_seqs * spec_k
    slots = cfg.max_num_seqs + snapshot_slots + verify_slots
    num_pages = cfg.num_pages or CacheManager.num_pages_for_memory(
        config, cfg.cache_memory_bytes, cfg.page_size, slots, cache_dtype, cfg.fp8_latent, latent_shards
    )
    prefix = None
    if cfg.enable_prefix_caching:
        prefix = PrefixCacheConfig(
            match_unit=cfg.prefix_match_unit,
            snapshot_interval=cfg.prefix_snapshot_interval,
            prompt_snapshots=cfg.prefix_prompt_snapshots,
            shared_prefill=cfg.prefix_shared_prefill,
            num_snapshot_slots=snapshot_slots,
            salt=model_salt(config, model if isinstance(model, torch.nn.Module) else None, cache_dtype, cfg.fp8_latent),
            host_bytes=cfg.cpu_offload_bytes,
            disk_dir=cfg.disk_offload_dir,
            disk_bytes=cfg.disk_offload_bytes,
        )
    cache = CacheManager(
        config,
        num_pages,
        cfg.page_size,
        cfg.max_num_seqs,
        dtype=cache_dtype,
        device=device,
        prefix=prefix,
        scratch=cfg.cuda_graphs,
        fp8_latent=cfg.fp8_latent,
        verify_slots=verify_slots,
        latent_shards=latent_shards,
    )
    return cache, num_pages


def build_proposer(
    model: CausalLM,
    cfg: EngineConfig,
    k: int,
    max_model_len: int,
    runner: ModelRunner,
    draft_model: CausalLM | None,
    mtp_layer: MTPLayer | None,
    eagle3_head: AnyEagle3Head | None,
) -> Proposer | None:
    """The draft's proposer for k tokens per step (check_drafts has allowed at most one draft), with the runner set to
    keep the hidden states it reads."""
    if mtp_layer is not None:
        runner.keep_hidden = True
        return MTPProposer(mtp_layer, k, cfg.max_num_seqs, max_model_len, cfg.page_size, cfg.seed)
    if eagle3_head is not None:
        if not isinstance(model, K3ForCausalLM):
            raise ValueError("an EAGLE-3 head reads the target's layer hidden states: the target must be a single-process K3ForCausalLM")
        runner.keep_hidden = True
        runner.aux_layers = eagle3_head.config.aux_layer_ids
        return Eagle3Proposer(eagle3_head, k, cfg.seed)
    if draft_model is not None:
        if draft_model.config.vocab_size != model.config.vocab_size:
            v, t = draft_model.config.vocab_size, model.config.vocab_size
            raise ValueError(f"draft model vocab_size={v} differs from the target's {t}: a draft must share the tokenizer")
        return DraftProposer(draft_model, k, cfg.max_num_seqs, max_model_len, cfg.page_size, cfg.seed)
    return None
