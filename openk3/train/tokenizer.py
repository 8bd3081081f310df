"""Train the demo model's byte-level BPE tokenizer and write it as `tokenizer.json` + `tokenizer_config.json` (chat template).

Byte-level: every byte is a base token, so any text encodes and decodes exactly; BPE merges are learnt on the training split
only. The special tokens come first (ids 0..4) and are never split or merged. The chat template is ChatML
(`<|im_start|>role\\ncontent<|im_end|>\\n`), the format Kimi's and most open chat models' users expect.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>")
BOS, EOS, PAD, IM_START, IM_END = SPECIAL_TOKENS

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int = 4096, min_frequency: int = 2):
    """A byte-level BPE `tokenizers.Tokenizer` with `vocab_size` entries including SPECIAL_TOKENS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size={vocab_size} is too small: expected >= {256 + len(SPECIAL_TOKENS)} (256 bytes + specials)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def tokenizer_config() -> dict:
    """What transformers' AutoTokenizer and openk3.serve.tokenizer read beside tokenizer.json."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "additional_special_tokens": [IM_START, IM_END],
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 8192,
        "chat_template": CHAT_TEMPLATE,
    }


def save_tokenizer(tok, path: str | Path) -> None:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    special_map = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "additional_special_tokens": [IM_START, IM_END]}
    (path / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")


def load_trained_tokenizer(path: str | Path):
    from tokenizers import Tokenizer

    path = Path(path)
    return Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path))


def render_chat(messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """The chat template applied with jinja2 (a transformers dependency), as a serving frontend would."""
    import jinja2

    env = jinja2.Environment(autoescape=False, undefined=jinja2.StrictUndefined)
    return env.from_string(CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=add_generation_prompt)
