"""EngineConfig: every setting of a serving engine, declared once. `LLM(model, **overrides)`, `openk3 serve` and
`openk3 generate` all read it: the flags are built from the declarations (openk3/options.py), and a value is checked the same
way whichever of them it came through.

The model's own placement (dtype, device, seed of a preset's random weights) is here too, for the entry points that build
the model; an engine given a built model takes its dtype and device from the model's parameters.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from openk3.options import check_settings, setting

if TYPE_CHECKING:  # torch is imported lazily: the CLI builds every command's flags from this class without loading it
    import torch

    from openk3.serve.scheduler import SchedulerConfig

DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class EngineConfig:
    # the model, for the entry points that build it
    dtype: str = setting("float32", "dtype of the weights (a torch.dtype is accepted too)", choices=DTYPES)
    device: str = setting("cpu", "device of the model and the cache (cpu, cuda, cuda:N)")
    seed: int = setting(0, "seed of a preset's random weights and of the generator shared by unseeded requests")
    # scheduler and cache
    max_model_len: int | None = setting(None, "longest prompt + completion in tokens (default: what the model and cache allow)", low=1)
    max_num_seqs: int = setting(64, "most requests in the running batch (= KDA state slots)", low=1)
    max_num_batched_tokens: int = setting(2048, "token budget of one engine step", low=1)
    long_prefill_token_threshold: int | None = setting(None, "prefill chunk size per request and step (default: the step budget)", low=1)
    encoder_cache_tokens: int = setting(16384, "image embeddings (in tokens) the vision encoder cache keeps", low=1)
    scheduling_policy: str = setting(
        "fcfs",
        "fcfs: arrival order (priority must be 0); priority: lowest priority value first, preempting larger values; "
        "fair: priority, then the client (the request's user) running fewest requests (docs/serving.md)",
        choices=("fcfs", "priority", "fair"),
    )
    page_size: int = setting(16, "tokens per MLA cache page", low=1)
    num_pages: int | None = setting(None, "MLA cache pages (default: as many as fit in the cache memory)", low=1)
    cache_memory_bytes: int = setting(256 * 2**20, "memory for MLA pages and KDA state slots", low=1, unit="MiB", flag="--cache-memory-mb")
    cache_dtype: torch.dtype | None = field(default=None)  # None: the model's parameter dtype
    kv_cache_dtype: str = setting(
        "auto",
        "MLA latent cache: auto (the cache dtype) or fp8 / fp8_e4m3 (e4m3 values with a scale per 64 channels, about half the bytes "
        "of bf16; the KDA state stays fp32 and the conv windows keep the cache dtype)",
        choices=("auto", "fp8", "fp8_e4m3"),
    )
    # prefix caching and its tiers (docs/serving.md)
    enable_prefix_caching: bool = setting(False, "reuse cached prefixes (MLA pages + KDA state snapshots)")
    prefix_match_unit: int = setting(64, "tokens; prefill chunks are cut and states snapshotted at its multiples", low=1)
    prefix_snapshot_interval: int | None = setting(None, "also snapshot every this many prompt tokens (dense, costs slots)", low=1)
    prefix_prompt_snapshots: int = setting(
        4, "states also taken inside a prompt's prefill at the deepest this many match-unit multiples (a repeat hits on its second send)", low=0
    )
    prefix_shared_prefill: bool = setting(
        True, "a waiting request that shares a new prefix with a running prompt's prefill waits for its state (serve/shared_prefill.py)"
    )
    num_snapshot_slots: int | None = setting(None, "state slots kept for prefix snapshots (default: a quarter of the cache memory)", low=0)
    cpu_offload_bytes: int = setting(0, "host-DRAM tier for evicted prefixes (0: none)", low=0, unit="GiB", flag="--cpu-offload-gb")
    disk_offload_dir: str | None = setting(None, "directory of the disk tier (a private subfolder is made and removed)")
    disk_offload_bytes: int = setting(0, "disk tier budget (needs --disk-offload-dir)", low=0, unit="GiB", flag="--disk-offload-gb")
    # CPU fp32: keep the projections also in oneDNN's blocked layout (used above 16 rows: prefill, wide decode steps; 1.4-2x
    # on the projection) and in the C kernel's panels (up to 16 rows: decode; 1.4x at 16 rows): copies made on first use
    # at those row counts (serve/prepare.py). For a model only the engine uses: the copy follows
    # load_state_dict and in-place writes, but not writes through `.data` or fused optimizer kernels, which bump no version
    # counter (an in-process trainer's). None: only for a model the entry point loads itself.
    pack_cpu_weights: bool | None = setting(
        None,
        "on CPU, also keep the projections in oneDNN's blocked layout and the C kernel's panels (faster above / up to 16 rows; extra copies of them)",
        flag="--cpu-weight-packing",
    )
    # decode steps from captured graphs (serve/graphs.py); off by default until a GPU run has measured them (docs/gpu.md)
    cuda_graphs: bool = setting(False, "replay decode steps from CUDA graphs captured per batch size and page-table width (needs a CUDA device)")
    cuda_graph_max_batch: int | None = setting(None, "largest decode batch replayed from a graph (default: max_num_seqs)", low=1)
    # speculative decoding (serve/speculative.py): a separate draft model that shares the target's tokenizer (draft.py),
    # the checkpoint's own multi-token-prediction layer (mtp_draft.py), or an EAGLE-3 head (eagle3_draft.py)
    speculative_method: str | None = setting(
        None,
        "speculative decoding: draft_model (a separate draft model, speculative_model), mtp (the checkpoint's multi-token-prediction layer) "
        "or eagle3 (an EAGLE-3 head folder, speculative_model); default draft_model when speculative_model is set, else none",
        choices=("draft_model", "mtp", "eagle3"),
    )
    speculative_model: str | None = setting(
        None,
        "draft for speculative decoding: a preset or checkpoint folder sharing the target's tokenizer (method draft_model), "
        "or an EAGLE-3 head folder (method eagle3)",
    )
    num_speculative_tokens: int = setting(3, "draft tokens proposed per decoding request and step (with a speculative method)", low=1, high=16)
    speculative_disable_by_batch_size: int | None = setting(
        None, "no request gets drafts in a step that begins with at least this many running requests (vLLM's disable_by_batch_size)", low=2
    )
    check_integrity_when_idle: bool = setting(True, "check the cache and scheduler invariants whenever the engine goes idle", cli=False)
    # implementations of the model's ops by name, set on its OpChoice before "auto" is resolved (serve/op_names.py); held
    # as the canonical "field=impl,..." (a dict is accepted too)
    ops: str | None = setting(
        None,
        "op implementations by name, set on the model's OpChoice: field=impl pairs such as kda=fla,mla=triton,mla_decode=triton,moe=triton "
        "(docs/serving.md lists the fields and names; default: the model's own choice, 'auto' resolved for the device)",
    )

    def __post_init__(self) -> None:
        dtype, device = _names(self.dtype, self.device)  # LLM(dtype=torch.bfloat16) as well as "bfloat16"
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "device", device)
        if self.ops is not None:
            from openk3.serve.op_names import format_op_names, parse_op_names

            object.__setattr__(self, "ops", format_op_names(parse_op_names(self.ops)))
        check_settings(self)
        if self.disk_offload_bytes > 0 and self.disk_offload_dir is None:
            raise ValueError(f"EngineConfig.disk_offload_bytes={self.disk_offload_bytes} needs disk_offload_dir")
        if (self.cpu_offload_bytes or self.disk_offload_bytes) and not self.enable_prefix_caching:
            raise ValueError("EngineConfig.cpu_offload_bytes / disk_offload_bytes offload cached prefixes: they need enable_prefix_caching=True")
        if self.cuda_graph_max_batch is not None and not self.cuda_graphs:
            raise ValueError(f"EngineConfig.cuda_graph_max_batch={self.cuda_graph_max_batch} sizes the decode graphs: it needs cuda_graphs=True")
        if self.cuda_graph_max_batch is not None and self.cuda_graph_max_batch > self.max_num_seqs:
            raise ValueError(
                f"EngineConfig.cuda_graph_max_batch={self.cuda_graph_max_batch}: a decode step has at most max_num_seqs={self.max_num_seqs} sequences"
            )
        if self.pack_cpu_weights and not self._cpu_fp32:
            raise ValueError(f"EngineConfig.pack_cpu_weights=True: oneDNN's packed weights are for CPU fp32 inference, not {self.device} {self.dtype}")
        if self.speculative_method == "mtp" and self.speculative_model is not None:
            raise ValueError(
                f"EngineConfig.speculative_model={self.speculative_model!r} with speculative_method='mtp': the MTP layer is read from the target's "
                "own checkpoint; leave speculative_model unset"
            )
        if self.speculative_disable_by_batch_size is not None and self.speculative is None:
            raise ValueError(
                f"EngineConfig.speculative_disable_by_batch_size={self.speculative_disable_by_batch_size} needs speculative decoding: "
                "set speculative_method or speculative_model"
            )
        if self.speculative_method == "draft_model" and self.speculative_model is None:
            raise ValueError("EngineConfig.speculative_method='draft_model' needs speculative_model: the draft model (a preset or checkpoint folder)")
        if self.speculative_method == "eagle3" and self.speculative_model is None:
            raise ValueError("EngineConfig.speculative_method='eagle3' needs speculative_model: the EAGLE-3 head's folder (config.json, model.safetensors)")

    @property
    def speculative(self) -> str | None:
        """The speculative method in effect: speculative_method, or draft_model when only speculative_model is set."""
        return self.speculative_method or ("draft_model" if self.speculative_model is not None else None)

    @property
    def _cpu_fp32(self) -> bool:
        return str(self.device).split(":")[0] == "cpu" and self.dtype == "float32"

    @property
    def fp8_latent(self) -> bool:
        return self.kv_cache_dtype in ("fp8", "fp8_e4m3")

    def with_packing_default(self, owns_model: bool) -> EngineConfig:
        """pack_cpu_weights resolved when unset: on for a model the entry point owns (nothing else writes to it), where it
        applies (CPU fp32); as set otherwise."""
        if self.pack_cpu_weights is not None:
            return self
        return dataclasses.replace(self, pack_cpu_weights=owns_model and self._cpu_fp32)

    @property
    def op_names(self) -> dict[str, str | int]:
        """The OpChoice fields `ops` names, with their implementations ({} when it names none)."""
        if self.ops is None:
            return {}
        from openk3.serve.op_names import parse_op_names

        return parse_op_names(self.ops)

    def check_ops_on_device(self) -> None:
        """Refuse a named implementation that cannot run on this device and dtype, or whose optional dependency (triton,
        fla) cannot be imported. For the entry points that build the model, before its weights load; an engine given a
        built model checks the names on the model's own device when it prepares it (serve/prepare.py)."""
        if self.ops is None:
            return
        import torch

        from openk3.ops.registry import OpTarget
        from openk3.serve.op_names import check_op_names, check_op_requirements

        names, target = self.op_names, OpTarget(torch.device(self.device).type, dtype=self.torch_dtype)
        check_op_names(names, target)
        check_op_requirements(names, target)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    def snapshot_slots(self, state_bytes: int) -> int:
        """State slots kept for prefix snapshots. By default a quarter of cache_memory_bytes (at least max_num_seqs): snapshots
        and pages share the one budget, and a fixed share keeps dense snapshots from starving the pages."""
        if not self.enable_prefix_caching:
            return 0
        if self.num_snapshot_slots is not None:
            return self.num_snapshot_slots
        if self.num_pages is not None or state_bytes == 0:
            return self.max_num_seqs
        return max(self.max_num_seqs, self.cache_memory_bytes // 4 // state_bytes)

    @property
    def scheduler(self) -> SchedulerConfig:
        from openk3.serve.policy import SchedulingPolicy
        from openk3.serve.scheduler import SchedulerConfig

        policy = SchedulingPolicy(self.scheduling_policy)
        return SchedulerConfig(self.max_num_batched_tokens, self.max_num_seqs, self.long_prefill_token_threshold, policy)


def _names(dtype: Any, device: Any) -> tuple[Any, Any]:
    """torch.dtype / torch.device values as the names the settings hold; anything else as given (check_settings judges it)."""
    if "torch" in type(dtype).__module__ or "torch" in type(device).__module__:
        import torch

        if isinstance(dtype, torch.dtype):
            dtype = str(dtype).removeprefix("torch.")
        if isinstance(device, torch.device):
            device = str(device)
    return dtype, device


@dataclass(frozen=True)
class FrontendConfig:
    """Admission control of the async front end (serve/async_engine.py), the server's: `LLM.generate` takes every request it is
    given, but a server under more load than it can serve should refuse early rather than queue without end. A request counts
    as waiting from the moment the engine accepts it until one of its samples is first scheduled (preempted samples are
    admitted work and do not count)."""

    max_waiting_requests: int | None = setting(256, "most requests waiting to be scheduled; beyond it a new request gets 503 with Retry-After", low=1)
    queue_timeout_s: float | None = setting(None, "seconds a request may wait to be scheduled before it is aborted with 503 (default: no limit)", low=0)
    step_timeout_s: float = setting(300.0, "a step running longer than this makes /health answer 503 (a stalled device or expert-parallel rank)", low=0.001)

    def __post_init__(self) -> None:
        check_settings(self)
