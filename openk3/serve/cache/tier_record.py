"""One prefix boundary as a self-describing, checksummed byte record: the disk tier's file format, and what a prefill engine
hands a decode engine (prefill/decode disaggregation, serve/cache/handoff.py).

Layout: MAGIC, the header length (8 bytes, little-endian), a JSON header {key, anchor, tail, num_tokens, nbytes, sha256} and the
payload (transfer.pack layout: KDA states, conv windows, then num_tokens MLA latents per MLA layer). `decode` checks everything
the record can check about itself (magic, header, payload size, SHA-256 of the payload, that the key is the hash of anchor and
tail) and raises TierRecordError naming what is wrong. Whether the payload fits *this* engine's cache (model shape, cache dtype,
page size) needs the engine's pools: `check_fits`.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from openk3.model.batch import CacheTensors
from openk3.serve.cache.hashing import snapshot_key
from openk3.serve.cache.tier_types import TierEntry
from openk3.serve.cache.transfer import buffer_nbytes

MAGIC = b"OPENK3PREFIX1\n"
LENGTH_BYTES = 8  # the header length field
_FIELDS = ("key", "anchor", "tail", "num_tokens", "nbytes", "sha256")


class TierRecordError(ValueError):
    """A prefix record that is malformed, corrupted, or made for a different cache than the one reading it."""


def _header(e: TierEntry, nbytes: int, sha256: str) -> bytes:
    fields = {
        "key": e.key.hex(),
        "anchor": e.anchor.hex(),
        "tail": list(e.tail),
        "num_tokens": e.num_tokens,
        "nbytes": nbytes,
        "sha256": sha256,
    }
    return json.dumps(fields).encode()


def encode(e: TierEntry) -> bytes:
    if e.buffer.dtype != torch.uint8 or e.buffer.dim() != 1 or e.buffer.device.type != "cpu":
        raise ValueError(f"tier_record.encode: the buffer must be flat uint8 on the host (got {e.buffer.dtype} {tuple(e.buffer.shape)} on {e.buffer.device})")
    payload = e.buffer.contiguous().numpy().tobytes()
    header = _header(e, len(payload), hashlib.sha256(payload).hexdigest())
    return MAGIC + len(header).to_bytes(LENGTH_BYTES, "little") + header + payload


def overhead_bytes(e: TierEntry) -> int:
    """Bytes of a record beyond its payload (magic, length, JSON header): about 240, plus up to 5 per tail token."""
    # the digest's hex is 64 characters whatever the payload: no need to hash it (the disk tier sizes every put by this)
    return len(MAGIC) + LENGTH_BYTES + len(_header(e, e.nbytes, "0" * 64))


def _field(header: dict[str, Any], name: str, kind: type) -> Any:
    value = header.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise TierRecordError(f"prefix record: header field {name!r} is {value!r}; expected a {kind.__name__}")
    return value


def _hex(header: dict[str, Any], name: str) -> bytes:
    try:
        return bytes.fromhex(_field(header, name, str))
    except ValueError:
        raise TierRecordError(f"prefix record: header field {name!r} is not hex") from None


def decode(data: bytes) -> TierEntry:
    """The entry a record holds, after checking magic, header, payload size and checksum."""
    start = len(MAGIC) + LENGTH_BYTES
    if not data.startswith(MAGIC):
        raise TierRecordError(f"prefix record: bad magic {bytes(data[: len(MAGIC)])!r} (expected {MAGIC!r})")
    if len(data) < start:
        raise TierRecordError(f"prefix record: {len(data)} bytes is too short for the header length field")
    hlen = int.from_bytes(data[len(MAGIC) : start], "little")
    if hlen > len(data) - start:
        raise TierRecordError(f"prefix record: header length {hlen} runs past the end of the {len(data)}-byte record")
    try:
        header = json.loads(data[start : start + hlen])
    except (ValueError, UnicodeDecodeError) as err:
        raise TierRecordError(f"prefix record: the header is not JSON ({err})") from None
    if not isinstance(header, dict) or set(header) != set(_FIELDS):
        got = sorted(header) if isinstance(header, dict) else type(header).__name__
        raise TierRecordError(f"prefix record: header fields {got}; expected {sorted(_FIELDS)}")
    key, anchor = _hex(header, "key"), _hex(header, "anchor")
    tail = _field(header, "tail", list)
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tail):
        raise TierRecordError("prefix record: header field 'tail' must list token ids (ints >= 0)")
    num_tokens, nbytes = _field(header, "num_tokens", int), _field(header, "nbytes", int)
    if not len(tail) <= num_tokens:
        raise TierRecordError(f"prefix record: boundary {num_tokens} is shorter than its tail of {len(tail)} tokens")
    payload = memoryview(data)[start + hlen :]
    if len(payload) != nbytes:
        raise TierRecordError(f"prefix record: payload has {len(payload)} bytes; the header says {nbytes} (truncated or padded)")
    if hashlib.sha256(payload).hexdigest() != _field(header, "sha256", str):
        raise TierRecordError("prefix record: payload checksum (SHA-256) does not match the header: the record is corrupted")
    if key != snapshot_key(anchor, tail):
        raise TierRecordError("prefix record: key is not the snapshot key of its anchor and tail")
    return TierEntry(key, anchor, tuple(tail), num_tokens, torch.frombuffer(bytearray(payload), dtype=torch.uint8))


def check_fits(e: TierEntry, tensors: CacheTensors) -> None:
    """Refuse an entry that this engine's pools cannot take as is: unpacking it would write garbage into the cache."""
    expected = buffer_nbytes(tensors, e.num_tokens)
    if e.nbytes != expected:
        raise TierRecordError(
            f"prefix record: {e.nbytes} payload bytes for {e.num_tokens} tokens, but this engine's cache needs {expected} "
            f"(KDA states + {e.num_tokens} MLA latents): it was made by a different model shape or cache dtype"
        )
    if len(e.tail) != e.num_tokens % tensors.page_size:
        raise TierRecordError(
            f"prefix record: a tail of {len(e.tail)} tokens at boundary {e.num_tokens} does not fit page size {tensors.page_size}: "
            "it was made by an engine with a different page size"
        )
