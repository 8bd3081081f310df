"""Admission control of the async front end (FrontendConfig): a bounded waiting queue and a queue timeout.

A server under more load than it can serve should refuse early (503 with Retry-After) rather than queue without end, and a
request that cannot be scheduled in time should end rather than hold its client forever. Only the engine thread sees the
queue exactly, so this object lives there (serve/async_engine.py calls it between steps). A request counts as waiting from the
moment the engine accepts it until one of its samples is first scheduled; preempted samples are admitted work and do not
count. Time comes from an injectable clock, so tests step it instead of sleeping.
Under the fair scheduling policy a full queue does not lock other clients out: a request whose client (SamplingParams.client)
waits with at least two fewer requests than the client waiting with the most takes the place of that client's newest
waiting request, which ends with QueueFullError as a refused request would; a request that names no client counts as a
client of its own. So one client's flood can fill the queue, and the next request of anyone else still gets in.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from openk3.serve.config import FrontendConfig
from openk3.serve.engine_api import ServedEngine
from openk3.serve.output import OutputProcessor


class QueueFullError(RuntimeError):
    """FrontendConfig.max_waiting_requests requests already wait to be scheduled; the request was not added."""


class QueueTimeoutError(RuntimeError):
    """The request waited to be scheduled longer than FrontendConfig.queue_timeout_s and was aborted."""


class Admission:
    """Engine thread only."""

    def __init__(self, engine: ServedEngine, processor: OutputProcessor, config: FrontendConfig, clock: Callable[[], float]) -> None:
        self.engine, self.processor, self.config, self._clock = engine, processor, config, clock
        # request id -> (core ids, arrival, client) of requests none of whose samples has been scheduled yet, in arrival order
        self._waiting: dict[str, tuple[list[str], float, str]] = {}

    @property
    def tracking(self) -> bool:
        return self.config.max_waiting_requests is not None or self.config.queue_timeout_s is not None

    def check_room(self, request_id: str, client: str | None = None) -> list[tuple[str, QueueFullError]]:
        """Raise QueueFullError when `max_waiting_requests` requests wait already -- unless, under the fair policy, the
        request (of `client`) takes a flooding client's place (module docstring): then that client's newest waiting request
        is returned with its error, for the caller to abort once the new request is added (aborted, it leaves the count)."""
        limit = self.config.max_waiting_requests
        if not self.tracking:
            return []
        self._prune()
        if limit is None or len(self._waiting) < limit:
            return []
        if self.engine.config.scheduling_policy == "fair":
            counts = Counter(c for _, _, c in self._waiting.values())
            top, most = counts.most_common(1)[0]
            if counts[_client_key(request_id, client)] + 2 <= most:
                victim = next(r for r in reversed(self._waiting) if self._waiting[r][2] == top)
                why = "the queue is full and this client holds the most of it: its newest waiting request made room for another client's"
                return [(victim, QueueFullError(f"{len(self._waiting)} requests were waiting to be scheduled (the limit); {why}: retry later"))]
        raise QueueFullError(f"{len(self._waiting)} requests are already waiting to be scheduled (the limit): retry later")

    def arrived(self, request_id: str, core_ids: list[str], client: str | None = None) -> None:
        if self.tracking:
            self._waiting[request_id] = (core_ids, self._clock(), _client_key(request_id, client))

    def expired(self) -> list[tuple[str, QueueTimeoutError]]:
        """The requests that have waited longer than `queue_timeout_s`, forgotten here (the caller aborts them)."""
        timeout = self.config.queue_timeout_s
        if timeout is None or not self._waiting:
            return []
        self._prune()
        now, out = self._clock(), []
        for request_id, (_, arrival, _) in list(self._waiting.items()):  # in arrival order: the first one still in time ends it
            waited = now - arrival
            if waited <= timeout:
                break
            del self._waiting[request_id]
            out.append((request_id, QueueTimeoutError(f"the request waited {waited:.1f} s to be scheduled, longer than the limit of {timeout:g} s")))
        return out

    def clear(self) -> None:
        self._waiting.clear()

    def _prune(self) -> None:
        """Forget requests that have left the queue: a sample scheduled, or the request finished or aborted."""
        for request_id, (core_ids, _, _) in list(self._waiting.items()):
            # was_scheduled: True once scheduled, None once the engine no longer knows the sample (finished or aborted)
            if request_id not in self.processor or any(self.engine.was_scheduled(c) is not False for c in core_ids):
                del self._waiting[request_id]


def _client_key(request_id: str, client: str | None) -> str:
    """A named client's share, or a request that names none as a client of its own (the prefixes keep the two apart)."""
    return f"client:{client}" if client is not None else f"request:{request_id}"
