"""ParallelConfig: how many ranks a model is spread over and how, declared once for `LLM(**overrides)` and `openk3 serve`
(flags built from the declarations, openk3/options.py), and the checks that concern an engine's settings together with it."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from openk3.options import check_settings, setting
from openk3.serve.config import EngineConfig


class EPMethod(str, enum.Enum):
    EP = "ep"  # contiguous experts, no balancing
    EPLB = "eplb"  # static placement with replicas of the measured hot experts (needs a load file: eplb_stats)
    MOONEP = "moonep"  # per-step balanced plan with expert prefetch


EP_METHODS = tuple(m.value for m in EPMethod)
KDA_CP_FORMS = ("sequential", "scan")  # ParallelConfig.kda_cp (the planner's --kda-cp names the same two)
STATS_NEEDED = (
    "expert parallel: method 'eplb' places replicas from measured expert load and needs a stats file (--eplb-stats FILE); "
    "export one from a run of the same model with --export-eplb-stats FILE, place from the live load with "
    "--eplb-interval-steps N, or use --ep-method ep or moonep"
)


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = setting(1, "tensor-parallel ranks: attention heads, MLPs, shared experts and vocabulary split over them (docs/parallel.md)", low=1)
    ep: int = setting(1, "expert-parallel ranks (LLM spawns them; openk3 serve runs one per torchrun process; docs/parallel.md)", low=1)
    dp: int = setting(
        1, "data-parallel attention groups (of --tp ranks each): each runs an engine (scheduler, cache, prefix cache) of its own; needs ep = dp x tp", low=1
    )
    cp: int = setting(
        1,
        "context-parallel ranks: a long prompt's prefill chunks split by position over them (MLA latents all-gathered, the KDA "
        "state handed rank to rank); decode runs whole on every rank (sharded with --dcp); with --tp T over cp x T ranks (--ep 1 or cp x T); "
        "not with --dp (docs/parallel.md)",
        low=1,
    )
    cp_min_tokens: int = setting(256, "--cp: a prefill step of one sequence with at least this many new tokens is split over the ranks", low=1)
    kda_cp: str = setting(
        "sequential",
        "--cp: how the KDA layers' recurrence crosses the ranks: the state handed rank to rank (sequential), or every rank at "
        "once, their state maps composed by a log-depth scan (scan: ~2x the recurrence's work, no rank waits for another's; docs/parallel.md)",
        choices=KDA_CP_FORMS,
    )
    decode_cp: bool = setting(
        False,
        "--cp: decode context parallelism: each CP rank keeps only its interleaved share of the MLA latent pages (1/cp of "
        "the bytes), a decode step attends each share and merges the parts by log-sum-exp (needs --page-size a multiple "
        "of --cp; docs/parallel.md)",
        flag="--dcp",
    )
    ep_method: str = setting(EPMethod.MOONEP.value, "how experts and tokens are spread over the ranks (docs/parallel.md)", choices=EP_METHODS)
    eplb_stats: str | None = setting(
        None, "measured expert load (a file written by --export-eplb-stats) that --ep-method eplb places its replicas from (docs/parallel.md)"
    )
    export_eplb_stats: str | None = setting(
        None,
        "when the engine stops, write the expert load it routed (entries per expert and MoE layer, summed over every step) to "
        "this file, for --eplb-stats (one process, --ep N or --tp N; not with --dp)",
    )
    eplb_interval_steps: int | None = setting(
        None,
        "--ep-method eplb: place the experts again every N steps from the load of the last N steps, moving weights between "
        "ranks while serving (without --eplb-stats the engine starts from an even placement; docs/parallel.md)",
        low=1,
    )
    ep_threads: int = setting(1, "torch threads of each worker rank LLM spawns", low=1, cli=False)
    ep_timeout_s: float = setting(
        300.0, "seconds one collective of the expert-parallel group may wait for a rank before the step fails (a stalled or dead rank)", low=1
    )
    heartbeat_timeout_s: float = setting(
        5.0, "seconds a rank may miss its heartbeat (beats every second, off the step path) before the group is declared lost and exits", low=2
    )

    def __post_init__(self) -> None:
        check_settings(self)
        self._check_load_files()
        if self.cp > 1 and (self.dp > 1 or self.ep not in (1, self.cp * self.tp)):
            raise ValueError(
                f"ParallelConfig: cp={self.cp} with tp={self.tp}, ep={self.ep}, dp={self.dp}: context parallelism runs over cp TP groups "
                f"(--cp C --tp T, C x T ranks), with the experts split by width in each (ep=1) or spread over all {self.cp * self.tp} "
                f"ranks (ep={self.cp * self.tp}); with --dp it is not built (docs/parallel.md)"
            )
        if self.cp == 1 and self.kda_cp != "sequential":
            raise ValueError(f"ParallelConfig: kda_cp={self.kda_cp!r} needs context parallelism (--cp 2 or more)")
        if self.decode_cp and self.cp == 1:
            raise ValueError("ParallelConfig: decode_cp=True (--dcp) with cp=1: decode context parallelism shards the MLA pages over --cp ranks; set cp >= 2")
        if self.cp > 1 and self.cp_min_tokens < self.cp:
            raise ValueError(f"ParallelConfig: cp_min_tokens={self.cp_min_tokens} is less than cp={self.cp}: every rank needs a token of a split step")
        if self.dp > 1 and self.ep != self.dp * self.tp:
            raise ValueError(
                f"ParallelConfig: dp={self.dp} with tp={self.tp}, ep={self.ep}: data-parallel attention spreads the experts over all "
                f"dp x tp = {self.dp * self.tp} ranks (ep={self.dp * self.tp}): the MoE layers are what the DP groups share (docs/parallel.md)"
            )
        if self.tp > 1 and self.ep > 1 and self.ep != self.tp and self.dp == 1 and self.cp == 1:
            raise ValueError(
                f"ParallelConfig: tp={self.tp} with ep={self.ep}: one engine runs its experts over its TP group (ep=1 or ep={self.tp}); "
                "ep = dp x tp spreads them over dp data-parallel groups of tp ranks (--dp, docs/parallel.md)"
            )

    def _check_load_files(self) -> None:
        eplb = self.ep > 1 and self.ep_method == EPMethod.EPLB.value
        if eplb and self.eplb_stats is None and self.eplb_interval_steps is None:
            raise ValueError(f"ParallelConfig: ep={self.ep}, ep_method='eplb' without eplb_stats: {STATS_NEEDED}")
        if self.eplb_interval_steps is not None and not eplb:
            raise ValueError(
                f"ParallelConfig: eplb_interval_steps={self.eplb_interval_steps} with ep={self.ep}, ep_method={self.ep_method!r}: "
                "re-placing experts while serving is EPLB's (ep > 1 and ep_method='eplb'); moonep balances every step by itself"
            )
        if self.eplb_stats is not None and not eplb:
            raise ValueError(
                f"ParallelConfig: eplb_stats={self.eplb_stats!r} with ep={self.ep}, ep_method={self.ep_method!r}: the load file places "
                "EPLB's replicas, so it is read only with ep > 1 and ep_method='eplb' (--ep N --ep-method eplb); drop it or use eplb"
            )
        if self.export_eplb_stats is not None and self.dp > 1:
            raise ValueError(
                f"ParallelConfig: export_eplb_stats={self.export_eplb_stats!r} with dp={self.dp}: each data-parallel rank routes only "
                "its own tokens and gathering their counts over the DP ranks is not built; export from a run with dp=1 "
                "(one process, --ep N or --tp N), whose rank 0 sees every token"
            )

    @property
    def latent_shards(self) -> int:
        """How many ranks share each MLA page's latents: cp with decode_cp, else 1 (every rank holds whole pages)."""
        return self.cp if self.decode_cp else 1

    @property
    def world_size(self) -> int:
        """Processes one engine runs on: dp groups of tp ranks, cp groups of tp ranks, or the TP group, whose ranks also hold
        the experts when ep > 1."""
        return self.dp * self.tp if self.dp > 1 else self.cp * self.tp if self.cp > 1 else max(self.tp, self.ep)

    def check_engine(self, engine: EngineConfig) -> None:
        """Refuse, on every rank alike and before any rank joins a group, what expert-parallel serving cannot do."""
        ranks = ", ".join([f"dp={self.dp}"] * (self.dp > 1) + [f"tp={self.tp}"] * (self.tp > 1) + [f"cp={self.cp}"] * (self.cp > 1) + [f"ep={self.ep}"])
        if self.decode_cp and engine.page_size % self.cp:
            raise ValueError(
                f"page_size={engine.page_size} with cp={self.cp}, decode_cp=True: each CP rank holds page_size / cp rows of every "
                f"MLA page, so page_size must be a multiple of cp (e.g. {self.cp * max(1, engine.page_size // self.cp)})"
            )
        if self.world_size > 1 and engine.pack_cpu_weights:
            # each rank prepares its own shard at start-up, unpacked; the engine's model is then a driver, not the weights
            raise ValueError(f"pack_cpu_weights=True (--cpu-weight-packing) with {ranks}: oneDNN's packed weights apply to a single-process engine only")
        if self.world_size > 1 and engine.speculative is not None:
            # the draft and its cache live beside a single-process engine (serve/draft.py, mtp_draft.py); ranks have no draft side
            method = engine.speculative
            raise ValueError(f"speculative_method={method!r} with {ranks}: speculative decoding runs in a single-process engine only (docs/serving.md)")
        if self.decode_cp and engine.fp8_latent:
            # each rank attends over its share of the pages and merges by LSE (cp/sharded_mla.py), reading plain rows only
            raise ValueError(
                f"kv_cache_dtype={engine.kv_cache_dtype!r} with {ranks}, decode_cp=True: the FP8 latent cache is not supported with "
                "decode context parallelism (its ranks read their share of the pages unpacked); it runs with --tp, --ep, --cp and --dp (docs/parallel.md)"
            )
        if self.world_size > 1 and engine.cuda_graphs:
            # a multi-rank step is the driver's broadcast plus collectives whose split sizes are read on the host
            raise ValueError(f"cuda_graphs=True with {ranks}: decode graphs capture a single-process step only (docs/gpu.md)")
        moe = engine.op_names.get("moe")
        if self.ep > 1 and moe not in (None, "auto"):
            # the expert-parallel backends (parallel/ep) run the routed experts in their own grouped form, not LocalExperts
            raise ValueError(
                f"ops moe={moe!r} with {ranks}: expert parallelism runs the routed experts in its own grouped form, which takes no "
                "implementation name; leave moe out of --ops (the other names apply on every rank)"
            )
        if self.world_size > 1 and engine.device.startswith("cuda:"):
            # each rank takes the GPU of its local rank; an explicit index would put every rank on that one device
            raise ValueError(f"device={engine.device!r} with {ranks}: rank r takes GPU r, so name no index (device='cuda')")
