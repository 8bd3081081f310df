"""On-policy distillation: the student samples through its own engine, the teachers score the samples through theirs, the
student minimises the per-token reverse KL on its own samples, and its new weights go back into its engine every step.

Legend: B prompts per step, P prompt tokens, C sampled tokens per prompt, k the teachers' top-k, V the student's vocabulary.

One step:
1. sample: the student's engine (an LLM over a serving copy of the student) continues B prompts, C tokens each, at the
   configured temperature (seeded per prompt, so a resumed run draws the same samples);
2. score: each sequence (prompt + sample) goes to its domain's teacher, its thinking segments to the reasoning teacher
   (train/teachers.py), whose engine returns the top-k logprobs of every position in the prefill (prompt logprobs);
3. train: the trainer's forward over the same sequences; the loss is the reverse KL(student || teacher) of the C positions
   that predicted sampled tokens, in the top-k form configured (train/distill_loss.py), averaged over them. As in GKD and in
   per-token on-policy distillation, the samples only choose the prefixes: the gradient of how a token changes the later
   prefixes (the sequence-level term) is left out;
4. sync: rl/weight_sync.update_weights copies the trainer's weights into the student's engine in place (the engine is idle
   between steps) and rekeys its prefix cache.
Each step's log line has the seconds of each phase and the tokens each handled (sampled, scored, trained), which
benchmarks/distill_demo.py turns into the cost split. QAT is refused: the engine serves the dense experts the trainer's
weights define, and a fake-quantised forward would train another model than the one sampling.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from openk3.checks import check_int, check_number
from openk3.config import ModelConfig
from openk3.llm import LLM
from openk3.rl.weight_sync import update_weights
from openk3.serve.sampling import SamplingParams
from openk3.train.data import TokenWindows
from openk3.train.distill_loss import Direction, TopK, topk_kl
from openk3.train.teachers import TeacherRouting, check_same_tokenizer, score_routed, serving_engine
from openk3.train.trainer import TrainConfig, Trainer


@dataclass(frozen=True)
class OnPolicyConfig:
    prompt_len: int = 16
    sample_len: int = 32
    k: int = 16  # the teachers' top-k per position
    approx: TopK = TopK.TAIL
    temperature: float = 1.0

    def __post_init__(self) -> None:
        for name in ("prompt_len", "sample_len", "k"):
            check_int("OnPolicyConfig", name, getattr(self, name), low=1)
        check_number("OnPolicyConfig", "temperature", self.temperature, low=0.0)


class DomainPrompts:
    """Prompts of P tokens cut from each domain's token stream; batch row r takes domain r mod (number of domains)."""

    def __init__(self, streams: Mapping[str, torch.Tensor], prompt_len: int, seed: int) -> None:
        if not streams:
            raise ValueError("DomainPrompts: no domains")
        self.domains = tuple(streams)
        self.windows = {d: TokenWindows(t, prompt_len - 1, seed + i) for i, (d, t) in enumerate(streams.items())}

    def next_batch(self, batch_size: int) -> tuple[list[list[int]], list[str]]:
        domains = [self.domains[r % len(self.domains)] for r in range(batch_size)]
        return [self.windows[d].next_batch(1)[0].tolist() for d in domains], domains

    def state_dict(self) -> dict:
        return {d: w.state_dict() for d, w in self.windows.items()}

    def load_state_dict(self, state: dict) -> None:
        for d, w in self.windows.items():
            w.load_state_dict(state[d])


class OnPolicyTrainer(Trainer):
    """The plain trainer whose batches are the student's own samples, scored by the teachers (module docstring).

    Contract: `engine` is the student's serving copy; nothing else may run requests on it during a step (weight sync needs
    it idle). `teachers` map names to LLMs whose tokenizers equal the student's (checked here, by id -> token)."""

    def __init__(
        self,
        model_config: ModelConfig,
        cfg: TrainConfig,
        on_policy: OnPolicyConfig,
        prompts: DomainPrompts,
        teachers: Mapping[str, LLM],
        routing: TeacherRouting,
        tokenizer: Any,
        held_out_WL1: torch.Tensor,
        out: Path | None,
        engine_options: Mapping[str, Any] | None = None,
    ) -> None:
        if cfg.qat_fraction > 0:
            raise ValueError(f"TrainConfig.qat_fraction={cfg.qat_fraction}: on-policy distillation trains the dense model its engine serves (0)")
        if cfg.seq_len != on_policy.prompt_len + on_policy.sample_len - 1:
            raise ValueError(f"TrainConfig.seq_len={cfg.seq_len}: on-policy steps train on prompt_len + sample_len - 1 positions")
        routing.check_teachers(list(teachers))
        check_same_tokenizer({"student": tokenizer} | {name: llm.tokenizer for name, llm in teachers.items()})
        super().__init__(model_config, cfg, prompts, held_out_WL1, out)
        self.on_policy, self.teachers, self.routing, self.prompts = on_policy, dict(teachers), routing, prompts
        options = {"max_num_seqs": cfg.batch_size, "max_model_len": cfg.seq_len + 8} | dict(engine_options or {})
        self.engine = serving_engine(self.model, tokenizer, **options)

    def resume(self) -> bool:
        resumed = super().resume()
        if resumed:
            update_weights(self.engine, self.model.state_dict())
        return resumed

    def sample(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """[B, P + C]: each prompt and the student engine's continuation of it."""
        cfg = self.on_policy
        base = self.step * len(prompts)
        params = [SamplingParams(max_tokens=cfg.sample_len, temperature=cfg.temperature, ignore_eos=True, seed=base + i) for i in range(len(prompts))]
        outs = self.engine.generate([list(p) for p in prompts], params)
        return torch.tensor([list(p) + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs, strict=True)])

    def reverse_kl(self, seqs_BS: torch.Tensor, topk_ids_BLk: torch.Tensor, topk_logprobs_BLk: torch.Tensor) -> torch.Tensor:
        """The student's per-token reverse KL [B * C] at the positions that predicted the sampled tokens."""
        first = self.on_policy.prompt_len - 1
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.cfg.bf16_autocast):
            logits = self.model.forward_tokens(seqs_BS[:, :-1])
        V, k = logits.shape[-1], topk_ids_BLk.shape[-1]
        rows = logits[:, first:].float().reshape(-1, V)
        return topk_kl(rows, topk_ids_BLk[:, first:].reshape(-1, k), topk_logprobs_BLk[:, first:].reshape(-1, k), Direction.REVERSE, self.on_policy.approx)

    def batch_loss(self) -> tuple[torch.Tensor, dict]:
        prompts, domains = self.prompts.next_batch(self.cfg.batch_size)
        t0 = time.perf_counter()
        seqs = self.sample(prompts)
        t1 = time.perf_counter()
        scored = score_routed(self.teachers, self.routing, seqs, domains, self.on_policy.k, self.prompts.domains)
        t2 = time.perf_counter()
        kl = self.reverse_kl(seqs, scored.topk_ids_WLk, scored.topk_logprobs_WLk)
        B, S = seqs.shape
        rec = {"kl": float(kl.detach().mean()), "sample_s": t1 - t0, "score_s": t2 - t1}
        rec |= {"sampled_tokens": B * self.on_policy.sample_len, "scored_tokens": B * (S - 1), "trained_tokens": kl.numel()}
        return kl.mean(), rec

    def after_step(self) -> dict:
        t0 = time.perf_counter()
        version = update_weights(self.engine, self.model.state_dict())
        return {"sync_s": time.perf_counter() - t0, "weight_version": version}

    def close(self) -> None:
        self.engine.close()
