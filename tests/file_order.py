"""The order in which xdist hands test files to its workers (`--dist loadfile`, the Makefile's
integration tier): the longest first.

A file is one unit of work, given to the next worker with little left, and xdist hands out first the
files with the most tests. Files of one to three long tests (kills and restarts of real processes,
the README's commands, bench/gpu.sh's dry run) came last, each on a worker of its own while the
others had nothing left. SLOW_FILES go first, longest first; the others follow, most tests first, as
xdist orders them. tests/conftest.py turns xdist's own reordering off and applies this one."""

from __future__ import annotations

import pytest

# The files of 30 worker-seconds or more: the sum of their tests' --durations (setup, call and
# teardown), session 39, the integration tier in four parts on 2 workers, the machine busy (loads of
# 3-15 on its 2 cores, so a figure is rough). Only their order is used. Simulated with xdist's
# scheduling on these figures and 3 workers, the tier's makespan: 1,102 s (most tests first) against
# 1,064 s (this order), the ideal 1,063 s.
SLOW_FILES: dict[str, int] = {
    "tests/test_batch_crash.py": 264,
    "tests/test_batch_clients.py": 197,
    "tests/test_cli_daily.py": 133,
    "tests/test_deploy.py": 107,
    "tests/test_delete_input.py": 105,
    "tests/test_up_lifecycle.py": 99,
    "tests/test_scheduler_policies.py": 89,
    "tests/test_crash.py": 88,
    "tests/test_gpu_script.py": 84,
    "tests/test_base_install.py": 82,
    "tests/test_console.py": 74,
    "tests/test_batch_lifecycle.py": 72,
    "tests/test_cluster.py": 67,
    "tests/test_batcher_triton.py": 62,
    "tests/test_stream_memory.py": 62,
    "tests/test_model_hot_updates.py": 59,
    "tests/test_client_sdk.py": 58,
    "tests/test_progress.py": 57,
    "tests/test_cli_client.py": 56,
    "tests/test_batches.py": 55,
    "tests/test_gateway_hostile_rpcs.py": 53,
    "tests/test_batch_watch.py": 53,
    "tests/test_batcher_models.py": 50,
    "tests/test_model_hung_exit.py": 45,
    "tests/test_readme_commands.py": 44,
    "tests/test_services_cli.py": 43,
    "tests/test_tls.py": 41,
    "tests/test_watch_jobs.py": 41,
    "tests/test_up_grpcurl.py": 39,
    "tests/test_tenant_quota_burst.py": 36,
    "tests/test_peer_watch.py": 34,
    "tests/test_console_batches.py": 31,
    "tests/test_client_edges.py": 31,
    "tests/test_gateway_hostile.py": 30,
    "tests/test_batcher_scheduler_restart.py": 30,
}


def longest_first(items: list[pytest.Item]) -> list[pytest.Item]:
    """The items, file by file: SLOW_FILES' first (longest first), then the others, most tests
    first (ties in their order); each file's tests in their order."""
    by_file: dict[str, list[pytest.Item]] = {}
    for item in items:
        by_file.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    order = sorted(by_file, key=lambda name: (-SLOW_FILES.get(name, 0), -len(by_file[name])))
    return [item for name in order for item in by_file[name]]
