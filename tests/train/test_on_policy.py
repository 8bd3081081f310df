"""On-policy distillation, one step on the debug model: the student samples through its engine, the teacher scores through
its engine's prompt logprobs, one optimizer step lowers the exact reverse KL to the teacher on a fixed sample set, and the
student's engine then serves the new weights (its version counts the update, its logprobs are the trainer's)."""

from typing import Any

import pytest
import torch

from openk3.config import debug
from openk3.llm import LLM
from openk3.model import K3ForCausalLM
from openk3.serve.sampling import SamplingParams
from openk3.serve.tokenizer import ByteTokenizer
from openk3.train.distill_loss import Direction, TopK, full_kl
from openk3.train.on_policy import DomainPrompts, OnPolicyConfig, OnPolicyTrainer
from openk3.train.teachers import TeacherRouting, TokenizerMismatch
from openk3.train.trainer import TrainConfig

P, C = 6, 10
ENGINE: dict[str, Any] = dict(max_num_seqs=8, max_model_len=64)


def teacher_model() -> K3ForCausalLM:
    m = K3ForCausalLM(debug())
    m.init_weights(seed=11)
    with torch.no_grad():
        m.lm_head.weight.mul_(8)  # a confident teacher, far from the student at init
    return m.eval()


def make_trainer(teacher: K3ForCausalLM, tokenizer=None) -> OnPolicyTrainer:
    g = torch.Generator().manual_seed(0)
    streams = {"a": torch.randint(0, 256, (400,), generator=g), "b": torch.randint(0, 256, (400,), generator=g)}
    cfg = TrainConfig(steps=4, batch_size=4, seq_len=P + C - 1, lr=3e-3, warmup_steps=0, eval_every=100, seed=2)
    teachers = {"t": LLM(teacher, ByteTokenizer(256), **ENGINE)}
    return OnPolicyTrainer(
        debug(),
        cfg,
        OnPolicyConfig(prompt_len=P, sample_len=C, k=32, approx=TopK.TAIL),
        DomainPrompts(streams, P, seed=0),
        teachers,
        TeacherRouting({"a": "t", "b": "t"}),
        tokenizer or ByteTokenizer(256),
        torch.randint(0, 256, (2, P + C), generator=g),
        None,
        ENGINE,
    )


def exact_reverse_kl(trainer: OnPolicyTrainer, teacher: K3ForCausalLM, seqs: torch.Tensor) -> float:
    with torch.no_grad():
        s = trainer.model.forward_tokens(seqs[:, :-1])[:, P - 1 :].reshape(-1, 256)
        t = teacher.forward_tokens(seqs[:, :-1])[:, P - 1 :].reshape(-1, 256)
    return float(full_kl(s, t, Direction.REVERSE).mean())


def test_one_step_lowers_the_reverse_kl_and_syncs_the_engine() -> None:
    teacher = teacher_model()
    trainer = make_trainer(teacher)
    g = torch.Generator().manual_seed(5)
    fixed_prompts = [torch.randint(0, 256, (P,), generator=g).tolist() for _ in range(4)]
    trainer.step = 100  # other seeds than the step's own samples
    fixed = trainer.sample(fixed_prompts)
    trainer.step = 0
    before = exact_reverse_kl(trainer, teacher, fixed)
    rec = trainer.train_step()
    after = exact_reverse_kl(trainer, teacher, fixed)
    assert after < before - 1e-3, (before, after)
    assert rec["weight_version"] == 1 and trainer.engine.engine.weight_version == 1
    assert rec["sampled_tokens"] == 4 * C and rec["scored_tokens"] == 4 * (P + C - 1) and rec["trained_tokens"] == 4 * C
    # the engine serves the trainer's new weights: its prompt logprobs are the trainer's forward
    seq = fixed[0].tolist()
    out = trainer.engine.generate([seq], SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0))[0]
    served = torch.tensor([s.logprob for s in out.prompt_logprobs or () if s is not None])
    with torch.no_grad():
        trainer.model.eval()
        own = trainer.model.forward_tokens(torch.tensor([seq[:-1]]))[0].float().log_softmax(-1)
    torch.testing.assert_close(served, own.gather(-1, torch.tensor(seq[1:])[:, None])[:, 0], atol=1e-4, rtol=1e-4)
    trainer.close()


def test_a_teacher_with_another_tokenizer_is_refused() -> None:
    with pytest.raises(TokenizerMismatch, match="id 256"):
        make_trainer(teacher_model(), tokenizer=ByteTokenizer(257))
