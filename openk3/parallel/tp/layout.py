"""What tensor parallelism over T ranks splits, checked once at start-up, and the config a rank's shard answers to.

Legend: T tensor-parallel ranks, H heads (KDA and MLA alike), I intermediate widths, V vocabulary.

Split over T: KDA heads (each rank owns H/T heads, their projections, conv channels, gate parameters and state slots),
MLA heads (q_b / kv_b / g by head, o_proj by its input; the latent projections and the cached latent are replicated: the
latent is shared by all heads), the dense MLP and the shared experts by intermediate width, the embedding and the LM head
by vocabulary rows. Routed experts are split by intermediate width too when expert parallelism is off (every rank runs
every token through its slice of every expert) and by expert when it is on (openk3.parallel.ep). Replicated: norms,
router, AttnRes mixers, the latent MoE projections.
"""

from __future__ import annotations

import dataclasses

from openk3.config import ModelConfig
from openk3.ops.mxfp4 import MX_BLOCK


def split_widths(config: ModelConfig, experts_split: bool) -> dict[str, int]:
    """Every width tensor parallelism divides, by the name a user finds in the config."""
    moe = config.moe
    widths = {
        "kda.num_heads": config.kda.num_heads,
        "mla.num_heads": config.mla.num_heads,
        "vocab_size": config.vocab_size,
    }
    if config.first_k_dense_replace:
        widths["intermediate_size"] = config.intermediate_size
    if moe.num_shared_experts:
        widths["moe.moe_intermediate_size x moe.num_shared_experts"] = moe.moe_intermediate_size * moe.num_shared_experts
    if experts_split:
        widths["moe.moe_intermediate_size"] = moe.moe_intermediate_size
    return widths


def check_tensor_parallel(config: ModelConfig, tp: int, experts_split: bool) -> None:
    """Refuse a TP size that does not divide every width it splits, naming each one; packed MXFP4 experts split by width
    also need whole scale blocks (32 values) per rank."""
    if tp < 1:
        raise ValueError(f"tensor parallel: tp={tp}, expected >= 1")
    if tp == 1:
        return
    problems = [f"{name}={width}" for name, width in split_widths(config, experts_split).items() if width % tp]
    if experts_split and config.expert_quantization == "mxfp4" and (config.moe.moe_intermediate_size // tp) % MX_BLOCK:
        problems.append(
            f"moe.moe_intermediate_size / tp = {config.moe.moe_intermediate_size // tp} (MXFP4 experts split by width need a multiple of {MX_BLOCK})"
        )
    if problems:
        raise ValueError(f"tensor parallel: tp={tp} does not divide {', '.join(problems)} (model {config.name!r})")


def rank_config(config: ModelConfig, tp: int) -> ModelConfig:
    """The config of one rank's shard as the engine sizes its cache pools from it: H/T KDA and MLA heads. Vocabulary,
    hidden and MLP widths stay the model's: their splits are internal to the parallel modules (logits come back whole)."""
    if tp == 1:
        return config
    kda = dataclasses.replace(config.kda, num_heads=config.kda.num_heads // tp)
    mla = dataclasses.replace(config.mla, num_heads=config.mla.num_heads // tp)
    return dataclasses.replace(config, kda=kda, mla=mla)
