"""RequestLimits: what one request may ask for, beyond the schema's own bounds, so that no single client can make the engine
do unbounded work. Each limit is a server setting (`openk3 serve --max-n ...`), and a request past one gets a 400 that states
the limit and the flag. Why these: `n` samples each take a running slot (one request with n = 128 would hold every slot of the
default 64); every stop string widens the per-step stop search and a stream's hold-back by its length; stop token ids are
checked on every sampled token; images are decoded, resized and run through the vision tower (api/images.py applies the
image limits).
"""

from __future__ import annotations

from dataclasses import dataclass

from openk3.api.errors import APIError
from openk3.api.protocol import MAX_N, _SamplingFields
from openk3.options import check_settings, setting


@dataclass(frozen=True)
class RequestLimits:
    max_n: int = setting(16, "most samples (n) one request may ask for", low=1, high=MAX_N)
    max_stop_strings: int = setting(16, "most stop strings one request may give", low=0)
    max_stop_string_length: int = setting(256, "longest stop string, in characters", low=1)
    max_stop_token_ids: int = setting(64, "most stop_token_ids one request may give", low=0)
    max_images_per_request: int = setting(8, "most images one request may send", low=0)
    max_image_bytes: int = setting(20 * 2**20, "largest image one request may send, decoded", low=1, unit="MiB", flag="--max-image-mb")
    max_image_pixels: int = setting(50_000_000, "most pixels (width x height) of one image, read from its header before decoding", low=1)

    def __post_init__(self) -> None:
        check_settings(self)

    def check(self, req: _SamplingFields) -> None:
        """A 400 naming the field, the value and the limit for the first limit `req` passes."""
        if req.n > self.max_n:
            self._refuse("n", f"n={req.n} is more than this server's limit of {self.max_n} samples per request", "--max-n")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stop) > self.max_stop_strings:
            self._refuse("stop", f"stop has {len(stop)} strings, more than this server's limit of {self.max_stop_strings}", "--max-stop-strings")
        longest = max(stop, key=len, default="")
        if len(longest) > self.max_stop_string_length:
            message = f"stop has a string of {len(longest)} characters, longer than this server's limit of {self.max_stop_string_length}"
            self._refuse("stop", message, "--max-stop-string-length")
        ids = req.stop_token_ids or []
        if len(ids) > self.max_stop_token_ids:
            message = f"stop_token_ids has {len(ids)} ids, more than this server's limit of {self.max_stop_token_ids}"
            self._refuse("stop_token_ids", message, "--max-stop-token-ids")

    @staticmethod
    def _refuse(param: str, message: str, flag: str) -> None:
        raise APIError(400, f"{message} (openk3 serve {flag})", param=param, code="limit_exceeded")
