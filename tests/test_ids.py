"""Job IDs (asyncinfer.ids): UUIDv7, ordered by creation as strings, never repeated, not even by
a forked child that inherited its parent's pool of random bytes."""

from __future__ import annotations

import os
import uuid

from asyncinfer.ids import is_job_id, new_job_id


def test_ids_are_uuid7_in_creation_order_and_unique() -> None:
    ids = [new_job_id() for _ in range(20_000)]  # several refills of the random pool
    assert ids == sorted(ids)
    assert len(set(ids)) == len(ids)
    for job_id in ids[::997]:
        parsed = uuid.UUID(job_id)
        assert (parsed.version, parsed.variant) == (7, uuid.RFC_4122)
        assert is_job_id(job_id)
    # The random part changes from one ID to the next, not only the counter.
    assert len({job_id[-12:] for job_id in ids}) == len(ids)


def test_a_forked_child_draws_its_own_random_bytes() -> None:
    new_job_id()  # the pool is filled in the parent
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next IDs' random parts, then out
        os.close(read_end)
        os.write(write_end, ",".join(new_job_id()[-12:] for _ in range(3)).encode())
        os._exit(0)
    os.close(write_end)
    parent = [new_job_id()[-12:] for _ in range(3)]
    with os.fdopen(read_end) as pipe:
        child = pipe.read().split(",")
    os.waitpid(pid, 0)
    assert len(child) == 3
    assert not set(child) & set(parent)
