"""When a request ends, decided in one place: the engine core applies these rules to every token it samples.

vLLM's order: the length first (max_tokens, or the context reaching max_model_len); then, once min_tokens are out, stop
tokens (EOS unless ignore_eos, and stop_token_ids); then stop strings, which win over the length. Stop strings need text, so
the request's text is made here too, once (one IncrementalDetokenizer per request), and reported with its tokens; the
output processor (output.py) only assembles it for callers.

Stop strings are looked for where the new text ends, over the last max(len(stop)) - 1 characters before it and the new
text, so the work per token does not grow with the text. The text is cut before the stop string (after it with
include_stop_str_in_output); a cut that reaches into text already reported is reported as characters to drop (a streamed
sample never sent them: output.py holds back that many). A stop token's own text is left out unless
include_stop_str_in_output.
"""

from __future__ import annotations

from dataclasses import dataclass

from openk3.serve.output_types import find_stop_string
from openk3.serve.request import Request, RequestStatus
from openk3.serve.sampling import SamplingParams
from openk3.serve.tokenizer import IncrementalDetokenizer, Tokenizer


def token_stop(req: Request, token: int, max_model_len: int, eos_token_id: int | None) -> RequestStatus | None:
    """The length and stop-token rules for the token just appended; sets `req.stop_reason` to a stop token id (None for EOS)."""
    p = req.sampling_params
    if req.num_tokens >= max_model_len or (p.max_tokens is not None and req.num_output_tokens >= p.max_tokens):
        return RequestStatus.FINISHED_LENGTH
    if req.num_output_tokens >= p.min_tokens and token in req.stop_token_ids:
        is_eos = token == eos_token_id or token in req.also_eos
        req.stop_reason = None if is_eos and token not in p.stop_token_ids else token
        return RequestStatus.FINISHED_STOPPED
    return None


def tokens_kept(req: Request, tokens: list[int], max_model_len: int) -> int:
    """How many of `tokens`, appended in order after req's tokens (a speculative run), to keep: through the first one the
    length or stop-token rules of token_stop would end the request on, else all."""
    p = req.sampling_params
    for i, token in enumerate(tokens):
        num_tokens, num_out = req.num_tokens + i + 1, req.num_output_tokens + i + 1
        if num_tokens >= max_model_len or (p.max_tokens is not None and num_out >= p.max_tokens):
            return i + 1
        if num_out >= p.min_tokens and token in req.stop_token_ids:
            return i + 1
    return len(tokens)


@dataclass(frozen=True)
class NewText:
    """What one token did to a request's text: `text` appended after dropping the last `dropped` characters reported."""

    text: str
    dropped: int = 0
    stop: str | None = None  # the stop string found, which ends the request


class RequestText:
    """A request's text as it grows, and its stop strings."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.params = params
        self.detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens)
        self.window = max((len(s) for s in params.stop), default=1) - 1  # what a stop string ending in new text reaches back into
        self.tail = ""  # the last `window` characters reported

    def add(self, token: int, status: RequestStatus | None, num_output_tokens: int) -> NewText:
        """The text of the token just sampled (`status`: what the token rules decided), cut at a stop string if one ends in it."""
        p = self.params
        new = "" if status is RequestStatus.FINISHED_STOPPED and not p.include_stop_str_in_output else self.detok.add(token)
        if status is not None:
            new += self.detok.flush()
        if p.stop and num_output_tokens > p.min_tokens and new:
            text = self.tail + new
            found = find_stop_string(text, len(new), p.stop, p.include_stop_str_in_output)
            if found is not None:
                stop, cut = found
                return NewText(text[len(self.tail) : max(cut, len(self.tail))], max(0, len(self.tail) - cut), stop)
        if self.window:
            self.tail = (self.tail + new)[-self.window :]
        return NewText(new)
