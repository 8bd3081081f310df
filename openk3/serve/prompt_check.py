"""The one rule for a prompt the engine can take, checked at the engine's door (LLMEngine.add_request) and used by the HTTP
API to name its own fields in the same refusal.

A prompt is a non-empty list of token ids inside the vocabulary that leaves room for at least one completion token:
fewer than `max_model_len` tokens (the sampled token's position must lie inside the context). PromptError says which part
failed (`code`, OpenAI's error codes) and renders the message with the caller's names for the prompt field.
"""

from __future__ import annotations


class PromptError(ValueError):
    """A prompt refused by the rule above; `str()` names the field "prompt", `message(name)` names it as the caller does."""

    def __init__(self, code: str, template: str) -> None:
        self.code = code  # "invalid_value" or "context_length_exceeded"
        self.template = template  # with {prompt} where the prompt field's name goes
        super().__init__(self.message("prompt"))

    def message(self, prompt_param: str) -> str:
        return self.template.format(prompt=prompt_param)


def check_prompt(ids: list[int], vocab_size: int, max_model_len: int) -> None:
    if not ids:
        raise PromptError("invalid_value", "{prompt} is empty: expected at least one token")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise PromptError("invalid_value", f"{{prompt}} has token id {bad}: expected ids in 0..{vocab_size - 1}")
    if len(ids) >= max_model_len:
        raise PromptError(
            "context_length_exceeded",
            f"This model's maximum context length is {max_model_len} tokens. However, the {{prompt}} has {len(ids)} tokens, "
            "which leaves none for the completion. Please reduce the length of the {prompt}.",
        )
