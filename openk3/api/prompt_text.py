"""Prompt text -> token ids off the event loop, refusing text that certainly cannot fit before it is tokenised.

Tokenising (and rendering a chat template) is plain CPU work that holds the GIL for as long as the text is long: on the event
loop it would stall every other connection, /health included. So it runs on a small thread pool of its own.
Before that, the size check: when each token of a tokenizer stands for at most B bytes of UTF-8 input, a text of b bytes
becomes at least ceil(b / B) tokens; so a text of more than (max_model_len - 1) * B bytes leaves no room for one completion
token, whatever it says, and is refused without tokenising it. Its character count is a lower bound on its byte count, so the
check looks at the character count first (free) and encodes to UTF-8 only when that does not decide.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import TypeVar

from openk3.api.errors import APIError
from openk3.api.user_text import PromptText, encode_prompt_text
from openk3.serve.tokenizer import Tokenizer

T = TypeVar("T")
TOKENIZER_THREADS = 2  # a long prompt occupies one thread; the other keeps short requests moving


def bytes_per_token_bound(tokenizer: Tokenizer) -> int | None:
    """The most input bytes one token can stand for, where that is certain; None where it is not known (then only the
    token count after tokenising is checked)."""
    # an optional member of the Tokenizer interface: ByteTokenizer's 1, a byte-level BPE's longest token (HFTokenizer without
    # a normalizer, KimiTokenizer), None or absent where no bound is certain
    bound = getattr(tokenizer, "max_bytes_per_token", None)
    return bound if isinstance(bound, int) else None


class PromptEncoder:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.bound = bytes_per_token_bound(tokenizer)
        self._pool = concurrent.futures.ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="openk3-tokenize")

    def check_size(self, text: str, param: str) -> None:
        """Refuse a text that certainly has more tokens than the context leaves for a prompt (module docstring)."""
        if self.bound is None:
            return
        limit = (self.max_model_len - 1) * self.bound
        if len(text) <= limit and len(text.encode("utf-8")) <= limit:
            return
        size = len(text.encode("utf-8"))
        at_least = -(-size // self.bound)
        raise APIError(
            400,
            f"This model's maximum context length is {self.max_model_len} tokens. However, the {param} is {size} bytes of text, "
            f"which this tokenizer turns into at least {at_least} tokens (at most {self.bound} bytes per token). "
            f"Please reduce the length of the {param}.",
            param=param,
            code="context_length_exceeded",
        )

    async def run(self, fn: Callable[[], T]) -> T:
        """fn() on the tokenizer threads (a cancelled caller does not wait for it)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    async def encode(self, text: str, param: str, add_special_tokens: bool = False) -> list[int]:
        self.check_size(text, param)
        return await self.run(lambda: self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    async def encode_prompt(self, prompt: PromptText, param: str) -> list[int]:
        """A rendered chat prompt: special tokens are read only outside its spans of request text (api/user_text.py)."""
        self.check_size(prompt.text, param)
        return await self.run(lambda: encode_prompt_text(self.tokenizer, prompt))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
