"""The engine requests of one HTTP request, added all or none, and their outputs merged into one stream (prompt index,
output) as they come, or run to their end."""

from __future__ import annotations

import asyncio
import dataclasses

from openk3.api.engine_job import EngineJob
from openk3.serve.async_engine import AsyncEngine, RequestStream
from openk3.serve.output import OutputKind, RequestOutput
from openk3.serve.request_ids import sample_id


class Updates:
    """(prompt index, output) for every engine request of one HTTP request, as they come; `aclose` aborts those unfinished."""

    def __init__(self, streams: list[RequestStream]) -> None:
        self._streams = streams
        # each prompt's weight version, fixed when it was added (a request runs on one version: AsyncEngine.call_idle)
        self.weight_versions = [stream.weight_version for stream in streams]
        self._queue: asyncio.Queue = asyncio.Queue()
        self._remaining = len(streams)
        self._tasks = [asyncio.ensure_future(self._pump(i, stream)) for i, stream in enumerate(streams)]

    async def _pump(self, i: int, stream: RequestStream) -> None:
        try:
            async for update in stream:
                if update.finished:  # a request runs on one weight version (AsyncEngine.call_idle): its final output says which
                    update = dataclasses.replace(update, weight_version=stream.weight_version)
                self._queue.put_nowait((i, update))
        except Exception as e:  # handed to the consumer, which raises it
            self._queue.put_nowait((i, e))

    def __aiter__(self) -> Updates:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if not self._remaining:
            raise StopAsyncIteration
        i, item = await self._queue.get()
        if isinstance(item, Exception):
            raise item
        if item.finished:
            self._remaining -= 1
        return i, item

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for stream in self._streams:
            await stream.aclose()


async def open_updates(frontend: AsyncEngine, request_id: str, jobs: list[EngineJob], kind: OutputKind) -> Updates:
    """Add every prompt of one HTTP request to the engine, all or none (a refusal -- bad input, a full queue -- aborts those
    already added), before the first byte of the response: so a refusal is still a plain HTTP error."""
    streams: list[RequestStream] = []
    try:
        for i, job in enumerate(jobs):
            engine_id = request_id if len(jobs) == 1 else sample_id(request_id, i)
            streams.append(await frontend.add(engine_id, job.prompt_token_ids, job.params, kind, job.images))
    except BaseException:
        for stream in streams:
            await stream.aclose()
        raise
    return Updates(streams)


async def final_outputs(frontend: AsyncEngine, request_id: str, jobs: list[EngineJob]) -> list[RequestOutput]:
    """Run every prompt of one HTTP request to its end; one whole output per prompt, in prompt order."""
    done: dict[int, RequestOutput] = {}
    updates = await open_updates(frontend, request_id, jobs, OutputKind.FINAL_ONLY)
    try:
        async for i, out in updates:
            done[i] = out
    finally:
        await updates.aclose()
    return [done[i] for i in range(len(jobs))]
