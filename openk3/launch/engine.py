"""build_engine: the one way an engine is built, for `LLM`, the server, each torchrun rank 0 and each Ray replica.

Every layout ends the same way -- a model in its serving layout, then an LLMEngine over it -- and differs only in where the
model lives:
- one process: the model is loaded (or the caller's module taken) and prepared here, then run by the engine;
- ranks spawned here (`LLM(ep=N)`, a replica of several ranks): each rank builds and prepares its own part at start-up
  (openk3.parallel.serving.ranks), and the engine runs rank 0's driver, which broadcasts each step to the others;
- rank 0 of a group already joined (torchrun): the same, over that group.
With data-parallel attention (dp > 1) every DP group runs an engine of its own and rank 0 steps them all
(DataParallelEngine). The engine never prepares its model: what it is given is already laid out.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import torch

from openk3.launch.spec import EngineSpec
from openk3.model import K3ForCausalLM
from openk3.model.eagle3_mla import AnyEagle3Head
from openk3.model.eagle3_mla_load import load_any_eagle3
from openk3.model.mtp import MTPLayer
from openk3.model.mtp_load import load_mtp
from openk3.parallel.dp.engine import DataParallelEngine
from openk3.parallel.group import ParallelContext
from openk3.parallel.layout import ServingPlan, apply_serving_layout
from openk3.parallel.serving.driver import EPDriver, EPTotals
from openk3.parallel.serving.local import LocalEP
from openk3.serve.config import EngineConfig
from openk3.serve.engine import LLMEngine
from openk3.serve.engine_api import ServedEngine
from openk3.serve.folder_files import log_folder_files
from openk3.serve.generation_config import GenerationConfig, read_generation_config
from openk3.serve.loading import ASSETS, build_model, model_tokenizer, resolve_model
from openk3.serve.runner import CausalLM
from openk3.serve.speculative import SpeculativeConfig
from openk3.serve.tokenizer import ByteTokenizer, Tokenizer

log = logging.getLogger("openk3.serve")


@dataclass
class Engine:
    """A built engine and what runs beneath it. Close `core` first, then `local_ranks` / `group` (the other ranks wait for
    rank 0's last step)."""

    core: ServedEngine  # what callers step or serve: `local`, or with dp > 1 the engine spread over every rank
    local: LLMEngine  # this process's own engine (with dp > 1 rank 0's: to inspect; stepping it alone breaks the lockstep)
    counted_model: CausalLM | None  # the model whose routing sees every token (rank 0's), None with dp > 1
    local_ranks: LocalEP | None = None  # ranks this process spawned
    group: EPDriver | DataParallelEngine | None = None  # rank 0 of a joined group: what drives the other ranks
    ep_totals: EPTotals | None = None  # rank 0's expert-parallel stats of a joined group, for /metrics

    generation: GenerationConfig = field(default_factory=GenerationConfig)  # the checkpoint's generation_config.json

    @property
    def tokenizer(self) -> Tokenizer:
        return self.core.tokenizer


def generation_config(spec: EngineSpec) -> GenerationConfig:
    """The checkpoint's generation_config.json (serve/generation_config.py); none for a module or a seeded preset. Logs
    what openk3 does with each file of the folder (serve/folder_files.py), once, as the engine is built."""
    if isinstance(spec.model, torch.nn.Module):
        return GenerationConfig()
    folder = resolve_model(spec.model)
    if folder is not None:
        log_folder_files(folder)
    generation = read_generation_config(folder)
    generation.log()
    return generation


def _tokenizer(spec: EngineSpec) -> Tokenizer:
    """The tokenizer of a model this process does not load itself (the ranks load their parts)."""
    if spec.tokenizer is not None:
        return spec.tokenizer
    if isinstance(spec.model, torch.nn.Module):
        return ByteTokenizer(max(256, cast(CausalLM, spec.model).config.vocab_size))
    return model_tokenizer(spec.model, spec.engine.seed, spec.byte_tokenizer)


def build_engine(spec: EngineSpec, group: ParallelContext | None = None) -> Engine:
    """The engine `spec` describes. `group`: this process is rank 0 of that joined group (torchrun), whose other ranks run
    the worker side of the same spec (launch/topology.py); without it a multi-rank layout spawns its ranks here."""
    if group is not None:
        return _build_on_group(spec, group)
    if spec.parallel.world_size > 1:
        return _build_on_local_ranks(spec)
    config = spec.engine
    if isinstance(spec.model, torch.nn.Module):
        net = cast(CausalLM, spec.model)  # any module obeying the contract (tests pass fakes)
        tokenizer = _tokenizer(spec)
    else:
        mtp = config.speculative == "mtp"
        net, tokenizer = build_model(spec.model, config.torch_dtype, config.device, config.seed, spec.byte_tokenizer, spec.tokenizer, mtp=mtp)
    param = next(iter(net.parameters()), None)
    device = param.device if param is not None else torch.device("cpu")  # where the engine runs it
    apply_serving_layout(cast(torch.nn.Module, net), ServingPlan(device, ops=config.op_names, pack_cpu_weights=config.pack_cpu_weights is True))
    generation = generation_config(spec)
    draft = _draft_model(spec, tokenizer, device)
    mtp_layer = _mtp_layer(spec, net, device)
    head = _eagle3_head(spec, net)
    speculative = None if config.speculative is None else SpeculativeConfig(config.num_speculative_tokens, config.speculative_disable_by_batch_size)
    engine = LLMEngine(net, tokenizer, config, generation.eos_token_ids, draft, speculative, mtp_layer, head)
    return Engine(engine, engine, net, generation=generation)


def _mtp_layer(spec: EngineSpec, net: CausalLM, device: torch.device) -> MTPLayer | None:
    """The checkpoint's multi-token-prediction layer when EngineConfig.speculative_method is "mtp" (model/mtp_load.py:
    with the target's op choice, as the target was prepared), in the same serving layout, or None."""
    config = spec.engine
    if config.speculative != "mtp":
        return None
    folder = None if isinstance(spec.model, torch.nn.Module) else resolve_model(spec.model)
    if folder is None or not isinstance(net, K3ForCausalLM):
        raise ValueError(f"speculative method 'mtp' reads the multi-token-prediction layer of the model's checkpoint folder; model={spec.model!r} is not one")
    layer = load_mtp(folder, net)
    apply_serving_layout(layer, ServingPlan(device, pack_cpu_weights=config.pack_cpu_weights is True))
    log.info("speculative decoding: the checkpoint's MTP layer, %d tokens per step", config.num_speculative_tokens)
    return layer


def _eagle3_head(spec: EngineSpec, net: CausalLM) -> AnyEagle3Head | None:
    """The EAGLE-3 head EngineConfig.speculative_model names when the method is "eagle3" (model/eagle3_load.py: on the
    target's device in its dtype), or None."""
    config = spec.engine
    if config.speculative != "eagle3":
        return None
    assert config.speculative_model is not None  # EngineConfig refuses eagle3 without it
    if not isinstance(net, K3ForCausalLM):
        raise ValueError("speculative method 'eagle3' reads the target's layer hidden states: the target must be a K3ForCausalLM")
    folder = Path(config.speculative_model)
    if not folder.is_dir() and (ASSETS / folder).is_dir():  # a shipped head by its path under the assets ("tiny/eagle3")
        folder = ASSETS / folder
    head = load_any_eagle3(folder, net)
    log.info(
        "speculative decoding: EAGLE-3 head %s (aux layers %s), %d tokens per step",
        config.speculative_model,
        head.config.aux_layer_ids,
        config.num_speculative_tokens,
    )
    return head


def _draft_model(spec: EngineSpec, tokenizer: Tokenizer, device: torch.device) -> CausalLM | None:
    """The draft model EngineConfig.speculative_model names, loaded like the target (same dtype, device and named ops) and
    read with the target's tokenizer (the engine refuses a draft of another vocabulary), or None."""
    config = spec.engine
    if config.speculative != "draft_model" or config.speculative_model is None:
        return None
    draft, _ = build_model(config.speculative_model, config.torch_dtype, device, config.seed, tokenizer=tokenizer)
    apply_serving_layout(cast(torch.nn.Module, draft), ServingPlan(device, ops=config.op_names, pack_cpu_weights=config.pack_cpu_weights is True))
    log.info("speculative decoding: draft model %s, %d tokens per step", config.speculative_model, config.num_speculative_tokens)
    return draft


def _unpacked(spec: EngineSpec) -> EngineConfig:
    # the ranks prepare their shards unpacked (ParallelConfig.check_engine refuses packing asked for); the driver holds no weights
    return dataclasses.replace(spec.engine, pack_cpu_weights=False)


def _build_on_local_ranks(spec: EngineSpec) -> Engine:
    config, tokenizer = _unpacked(spec), _tokenizer(spec)
    ranks = LocalEP(spec.model, spec.parallel, config.torch_dtype, config.device, config.seed, config, tokenizer)
    try:
        if ranks.dp_engine is not None:
            return Engine(ranks.dp_engine, ranks.dp_engine.local, None, local_ranks=ranks)
        assert ranks.driver is not None
        generation = generation_config(spec)
        engine = LLMEngine(ranks.driver, tokenizer, config, generation.eos_token_ids, latent_shards=spec.parallel.latent_shards)
    except BaseException:
        ranks.close()
        raise
    return Engine(engine, engine, ranks.driver.model, local_ranks=ranks, generation=generation)


def _build_on_group(spec: EngineSpec, group: ParallelContext) -> Engine:
    from openk3.parallel.serving.dp_ranks import start_dp_leader
    from openk3.parallel.serving.ranks import start_driver

    config, rank_spec = _unpacked(spec), spec.rank_spec(collect_stats=True)
    if spec.parallel.dp > 1:
        timeout = datetime.timedelta(seconds=spec.parallel.ep_timeout_s)
        dp_engine = start_dp_leader(group, rank_spec, config, _tokenizer(spec), timeout)
        return Engine(dp_engine, dp_engine.local, None, group=dp_engine, ep_totals=dp_engine.ep_totals)
    driver, _ = start_driver(group, rank_spec)
    try:
        generation = generation_config(spec)
        engine = LLMEngine(driver, _tokenizer(spec), config, generation.eos_token_ids, latent_shards=spec.parallel.latent_shards)
    except BaseException:
        driver.close()
        raise
    return Engine(engine, engine, driver.model, group=driver, ep_totals=driver.totals, generation=generation)
