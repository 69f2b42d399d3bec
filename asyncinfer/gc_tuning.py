"""The garbage collector's settings for a serving process, applied once it has started.

After start-up a service's heap (torch and the model, protobuf descriptors, gRPC, the config) holds
~200,000 container objects that live as long as the process, and every full collection walks them
all. Measured on the batcher benchmark (MLP, 128 clients, 7.5 s): with CPython's defaults the
collector ran 375 young, 34 middle and 3 full collections, 0.53 s in all (7% of the process's time),
and each full one stalled every request in flight (p99 258 ms); with the settings below, 7 young
collections, 0.03 s, p99 120 ms.

`gc.freeze()` moves the start-up heap out of the collector's sight, and a young generation of 10,000
objects instead of 700 makes young collections ~14x rarer: what a request allocates mostly dies
young, but at high concurrency many requests are in flight at each collection, and survivors are
promoted into the generations that are walked more slowly. Cyclic garbage is still collected; at
most 10,000 young objects wait for it.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 10_000
OLDER_THRESHOLDS = (10, 10)  # CPython's defaults


def tune_for_serving() -> None:
    """Freeze what start-up left on the heap and make young collections rarer. Call it once the
    process has loaded everything it keeps (models, stubs, config)."""
    gc.collect()  # what start-up left as garbage is not frozen with the rest
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, *OLDER_THRESHOLDS)
