"""Tensor and expert parallelism of the reference network (issue 30, step 1): the sharding layout (`layout`), the
deterministic collectives (`comm`), the sharded modules (`modules`), slice-wise checkpoint reads (`shards`), the
parallel network and its loader (`network`), and a local multi-process launcher (`launch`).

Only `layout` is imported here: it needs no torch, so a planner can size a deployment without importing it.
"""

from __future__ import annotations

from ced.parallel.layout import ParallelLayout as ParallelLayout
from ced.parallel.layout import ParallelLayoutError as ParallelLayoutError
from ced.parallel.layout import Shard as Shard
from ced.parallel.layout import sharding_plan as sharding_plan
