"""The one scheme for ids derived from a caller's request id: its i-th part is "{id}-{i}".

Used wherever one caller request becomes several engine requests: the n samples of a request (output.py) and the prompts of
a batched completion request (the API's jobs); a batched request's samples are "{id}-{prompt}-{sample}". Callers' ids are
unique among unfinished requests (the engine and the output processor refuse a duplicate), so derived ids are too as long
as no caller picks an id of this form for a request of its own while the parent runs; such a clash is refused as a
duplicate, never merged.
"""

from __future__ import annotations


def sample_id(request_id: str, index: int) -> str:
    """The id of part `index` (a sample, or a prompt of a batch) of the caller's request `request_id`."""
    return f"{request_id}-{index}"
