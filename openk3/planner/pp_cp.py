"""Pipeline and context parallelism for long prefill: how TTFT at 1M tokens comes under an SLO.

Without either, one prompt runs on one attention group (TP ranks; with DP attention a single accelerator) chunk after
chunk, so a 1M-token prompt's attention and trunk work sits on that group alone. Two ways to spread it:

- **PP** (`pp` stages): the instance's accelerators split into `pp` stages of `n / pp`, each holding `1 / pp` of the
  layers (experts spread over the stage's ranks: the same expert bytes per rank). Chunks of one prompt pipeline through
  the stages -- chunk c at stage s needs only chunk c-1's KV and KDA state at that stage's layers, which that stage
  computed itself -- so TTFT = (chunks + pp - 1) x (chunk time / pp + one activation hop). The bubble is
  (pp - 1) / (chunks + pp - 1). A hop carries the chunk's residual stream and AttnRes block summaries (bf16), striped
  over the TP ranks, over NVLink when the instance sits in one scale-up domain, else over the NIC. Layers are assumed to
  split evenly (the embedding and head on the end stages are ignored). Decode on a PP layout keeps the same per-rank
  weights, cache and batch (pp micro-batches in flight), so its step is priced as without PP plus pp - 1 hops.
- **CP** (`cp` ranks, i.e. `cp` of the attention-DP groups of a stage cooperating on one prompt): each takes `1 / cp` of
  the tokens, sharded zig-zag so each holds an early and a late block and does `1 / cp` of the causal attention pairs.
  MLA runs ring attention: each rank receives the other ranks' latent, `(cp - 1) / cp` of the prompt per MLA layer,
  overlapped with its attention compute (only the excess is exposed). After prefill the shards are gathered into the
  group that decodes the sequence (the planner's decode assumes a whole latent per group).
  KDA is a recurrence: the state at the start of rank r's tokens is the end state of rank r - 1. Two assumptions, named by
  `KDASplit`: `sequential` (the default, what a plain implementation does): each KDA layer's recurrence runs rank after
  rank, so KDA's share of the prefill is not divided by cp, and the per-layer state (its recurrent state and conv
  windows) hops cp - 1 times; `scan` (openk3's `--kda-cp scan`, parallel/cp/kda_scan.py): each rank runs its tokens
  at once, from the state [0 | I] over values widened by K zero columns, which yields its block's state map
  S -> A S + B and the outputs' dependence on the start in one run (`SCAN_WORK` x the rank's KDA work, divided by cp),
  an exclusive scan composes each rank's predecessors' maps in 1 + ceil(log2(cp - 1)) rounds of point-to-point messages
  (a rank receives at most one map [B | A], twice the state where K = V, per round), and each rank corrects its
  outputs with the start state that gives it.

The base layout must fit as it is; PP and CP only lower what a rank holds (1 / pp of the trunk, 1 / cp of a prompt's
cache while it is prefilled), which the planner does not credit. openk3 runs no PP, and its CP over TP groups is not yet
the planner's CP layout (`runtime.py`); its CP prefill (openk3/parallel/cp) is what `cp_bytes` is checked against, both
KDA forms (benchmarks/context_parallel.py, tests/parallel).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, replace

from openk3.config import ModelConfig
from openk3.planner.attention import attention_shape
from openk3.planner.inputs import Quantisation
from openk3.planner.memory import attn_res_slots, cache_spec
from openk3.planner.perf import Metrics, Scenario, prefill_step

SCAN_WORK = 2.0  # a scan rank builds its block's transition beside the zero-state pass, then corrects: ~2x the KDA work
HOP_FLOOR_S = 10e-6  # one point-to-point send's fixed cost (the all-reduce floor of CommParams)


class KDASplit(str, enum.Enum):
    SEQUENTIAL = "sequential"
    SCAN = "scan"


@dataclass(frozen=True)
class LongPrefill:
    pp: int
    cp: int
    kda: KDASplit
    ttft_s: float
    plain_ttft_s: float  # the same layout with neither
    chunks_per_rank: int
    stage_s: float  # one chunk on one stage of one CP rank
    bubble: float  # share of the pipeline's slots that are idle
    hop_s: float  # one PP activation hop
    ring_s: float  # ring-attention transfer per CP rank, before overlap
    ring_exposed_s: float
    kda_extra_s: float  # what KDA's recurrence adds over a perfect 1 / cp split
    gather_s: float  # the CP shards of the prompt's cache gathered into the decoding group
    decode_hop_s: float  # added to each decode step by the PP hops

    def describe(self) -> str:
        parts = [f"PP{self.pp}"] if self.pp > 1 else []
        if self.cp > 1:
            parts.append(f"CP{self.cp} (KDA {self.kda.value})")
        return " x ".join(parts) or "no PP/CP"


def _link_bw(sc: Scenario, inside: bool) -> float:
    s, c = sc.system, sc.comm
    return s.accelerator.scale_up_bw * c.scale_up_efficiency if inside else s.scale_out_bw * c.scale_out_efficiency


def layout_problem(sc: Scenario, pp: int, cp: int) -> str | None:
    n, tp = sc.layout.num_accelerators, sc.layout.tp
    if pp < 1 or cp < 1:
        return f"pp={pp}, cp={cp}: expected >= 1"
    if n % pp or (n // pp) % tp:
        return f"pp={pp} does not split {n} accelerators into stages of whole TP{tp} groups"
    if ((n // pp) // tp) % cp:
        return f"cp={cp} does not divide the {(n // pp) // tp} attention groups of a stage"
    return None


def hop_bytes(sc: Scenario, tokens: float) -> float:
    """Activations crossing a stage boundary: the residual stream and AttnRes block summaries, bf16."""
    return tokens * sc.config.hidden_size * 2 * (1 + attn_res_slots(sc.config))


@dataclass(frozen=True)
class CPBytes:
    """What one CP rank receives while one prompt is prefilled, per layer, as long_prefill prices it (one TP rank's
    share); benchmarks/context_parallel.py checks these against the bytes openk3's CP prefill logs."""

    mla_per_layer: float  # the other ranks' latents of one MLA layer: (cp - 1) / cp of the prompt
    kda_hop: float  # one KDA layer's recurrent state and conv windows, handed on once
    kda_hops_per_layer: int  # hand-offs per KDA layer on the critical path: cp - 1 (sequential), 1 + ceil(log2(cp - 1)) (scan)
    gather: float  # the other ranks' shards of the prompt's whole cache, gathered into the decoding group
    kda_map: float = 0.0  # scan: one rank's state map [B | A] of one KDA layer, one round's message
    kda_per_rank: float = 0.0  # the most one rank receives per KDA layer: kda_hop, or its conv windows + one map per round


def cp_bytes(config: ModelConfig, quant: Quantisation, tp: int, prompt: float, cp: int, kda: KDASplit = KDASplit.SEQUENTIAL) -> CPBytes:
    spec = cache_spec(config, quant)
    n_kda = spec.kda.num_layers if config.kda_layers else 0
    per_token = spec.mla.bytes_per_token_per_layer / attention_shape(config).kv_split(tp)
    hops = 0 if cp == 1 or n_kda == 0 else (cp - 1 if kda == KDASplit.SEQUENTIAL else 1 + math.ceil(math.log2(cp - 1)))
    mla = (cp - 1) / cp * prompt * per_token
    hop = spec.kda.bytes_per_sequence / max(n_kda, 1) / tp
    state = config.kda.num_heads * config.kda.head_dim**2 * 4 / tp if n_kda else 0.0  # fp32 [H, K, V], K = V
    kda_map = 2 * state if kda == KDASplit.SCAN and hops else 0.0
    per_rank = 0.0 if hops == 0 else hop if kda == KDASplit.SEQUENTIAL else hop - state + hops * kda_map
    return CPBytes(mla, hop, hops, mla * spec.mla.num_layers, kda_map, per_rank)


def long_prefill(sc: Scenario, pp: int = 1, cp: int = 1, kda: KDASplit = KDASplit.SEQUENTIAL) -> LongPrefill:
    problem = layout_problem(sc, pp, cp)
    if problem:
        raise ValueError(problem)
    layout, config = sc.layout, sc.config
    prompt = sc.workload.prompt_tokens
    chunk = min(sc.workload.prefill_chunk, prompt)
    stage_layout = replace(layout, num_accelerators=layout.num_accelerators // pp, ep=None, redundant_experts=layout.redundant_experts // pp)
    stage_sc = sc.with_(layout=stage_layout)
    # a chunk of one CP rank: its queries see (prompt + 1) / 2 keys on average (zig-zag sharding keeps the causal mean)
    step = prefill_step(stage_sc, kv_len=(prompt - chunk) / 2, mean_keys=(prompt + 1) / 2)
    plain = prefill_step(sc)
    chunks = -(-prompt // chunk)
    chunks_rank = -(-math.ceil(prompt / cp) // chunk)
    by = {c.name: c for c in step.components}
    kda_t = by["kda"].time_s if "kda" in by else 0.0
    spec = cache_spec(config, sc.quant)
    n_kda = spec.kda.num_layers if config.kda_layers else 0
    sent = cp_bytes(config, sc.quant, layout.tp, prompt, cp, kda)
    kda_bw = _link_bw(sc, cp * layout.tp <= sc.system.scale_up_domain)
    # per KDA layer on the critical path: the state's chain of hops, or the scan's rounds (one map each)
    rounds = max(sent.kda_hops_per_layer, 1)
    state_hop = HOP_FLOOR_S + (sent.kda_hop if kda == KDASplit.SEQUENTIAL else sent.kda_per_rank / rounds) / kda_bw
    hops = n_kda * sent.kda_hops_per_layer
    factor = 1.0 if hops == 0 else (float(cp) if kda == KDASplit.SEQUENTIAL else SCAN_WORK)
    chunk_s = step.total_s + (factor - 1) * kda_t
    kda_extra = chunks_rank * (factor - 1) * kda_t + hops * state_hop
    inside = layout.num_accelerators <= sc.system.scale_up_domain
    hop = HOP_FLOOR_S + hop_bytes(sc, chunk) / layout.tp / _link_bw(sc, inside) if pp > 1 else 0.0
    stage = chunk_s / pp
    pipeline = (chunks_rank + pp - 1) * (stage + hop)
    cp_inside = cp * layout.tp <= sc.system.scale_up_domain
    ring = sent.gather / _link_bw(sc, cp_inside)  # every MLA layer's share of the other ranks' latents
    attention = chunks_rank * sum(c.time_s for c in step.components if c.name in ("mla_attention", "attention"))
    ring_exposed = max(0.0, ring - attention)
    gather = ring if cp > 1 else 0.0  # the other ranks' shards, (cp - 1) / cp of the prompt, into one group
    tokens = sc.workload.concurrency / layout.dp if sc.workload.concurrency else 0.0
    decode_hop = (pp - 1) * (HOP_FLOOR_S + hop_bytes(sc, tokens) / layout.tp / _link_bw(sc, inside)) if pp > 1 else 0.0
    return LongPrefill(
        pp=pp,
        cp=cp,
        kda=kda,
        ttft_s=pipeline + hops * state_hop + ring_exposed + gather,
        plain_ttft_s=chunks * plain.total_s,
        chunks_per_rank=chunks_rank,
        stage_s=stage,
        bubble=(pp - 1) / (chunks_rank + pp - 1),
        hop_s=hop,
        ring_s=ring,
        ring_exposed_s=ring_exposed,
        kda_extra_s=kda_extra,
        gather_s=gather,
        decode_hop_s=decode_hop,
    )


def options(sc: Scenario, max_pp: int, max_cp: int, kda: KDASplit) -> list[LongPrefill]:
    """Every (pp, cp) the layout admits up to the limits: pp powers of two, cp any divisor of a stage's groups."""
    out = []
    pps = [p for p in (2**i for i in range(0, 12)) if p <= max_pp]
    for pp in pps:
        for cp in range(1, max_cp + 1):
            if (pp, cp) != (1, 1) and layout_problem(sc, pp, cp) is None:
                out.append(long_prefill(sc, pp, cp, kda))
    return out


def fix_ttft(sc: Scenario, max_ttft_s: float, max_pp: int, max_cp: int, kda: KDASplit) -> LongPrefill | None:
    """The least PP x CP that brings TTFT under `max_ttft_s` (fewest ranks per prompt, then lowest TTFT); without one,
    the lowest TTFT any option reaches (so the report can say how close it gets); None when no option is allowed."""
    opts = options(sc, max_pp, max_cp, kda)
    if not opts:
        return None
    ok = [o for o in opts if o.ttft_s <= max_ttft_s]
    if ok:
        return min(ok, key=lambda o: (o.pp * o.cp, o.ttft_s))
    return min(opts, key=lambda o: o.ttft_s)


def with_long_prefill(m: Metrics, lp: LongPrefill) -> Metrics:
    """The candidate's figures with PP/CP prefill: its TTFT, and decode slowed by the PP hops on every step."""
    step = m.decode.total_s
    slow = step / (step + lp.decode_hop_s)
    return replace(
        m,
        ttft_s=lp.ttft_s,
        per_user_tok_s=m.per_user_tok_s * slow,
        throughput_tok_s=m.throughput_tok_s * slow,
        tokens_per_joule=m.tokens_per_joule * slow,
        usd_per_m_output=m.usd_per_m_output / slow,
    )
