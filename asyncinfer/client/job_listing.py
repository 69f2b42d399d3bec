"""What `AsyncClient.list` returns: the caller's jobs as an async iterator over ListJobs' pages,
fetched as it is iterated, which also counts the jobs the gateway left out of them unreadable."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable

from asyncinfer.client._convert import job_from_proto
from asyncinfer.client.types import Job
from asyncinfer.v1 import job_service_pb2

# One ListJobs call: the page after the token ("" for the first).
PageCall = Callable[[str], Awaitable[job_service_pb2.ListJobsResponse]]


class JobListing:
    """The jobs, newest first (`async for`), each page one call as the iteration reaches it;
    `limit` stops after that many. `unreadable_skipped`: how many jobs the pages fetched so far
    left out because the gateway cannot decode their record (a later release's, during a rolling
    upgrade, or a corrupted one: GetJob answers each InternalError JOB_UNREADABLE); 0 from a
    gateway before session 39, which left them out unsaid. `aclose` ends it, as a generator's."""

    def __init__(self, page: PageCall, *, limit: int | None) -> None:
        self.unreadable_skipped = 0
        self._page = page
        self._limit = limit
        self._jobs = self._iterate()

    def __aiter__(self) -> JobListing:
        return self

    def __anext__(self) -> Awaitable[Job]:
        return self._jobs.__anext__()

    async def aclose(self) -> None:
        await self._jobs.aclose()

    async def _iterate(self) -> AsyncGenerator[Job, None]:
        limit = self._limit
        token = ""
        yielded = 0
        while True:
            page = await self._page(token)
            self.unreadable_skipped += page.unreadable_skipped
            for message in page.jobs:
                if limit is not None and yielded >= limit:
                    return
                yield job_from_proto(message)
                yielded += 1
            token = page.next_page_token
            if not token or (limit is not None and yielded >= limit):
                return
