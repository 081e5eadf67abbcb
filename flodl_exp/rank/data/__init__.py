"""The rank's data plane: budgets, the tiered sample cache, the prefetch pipeline.

- ``budget``: pure budget laws (algorithms.md section 10).
- ``layout``: per-sample row layout (what caches store, how batches are rebuilt).
- ``stores``: RAM slabs, CUDA device pool, disk-stage pack file.
- ``cache``: ``SampleCache``, exact batches from the fastest tier holding each sample.
- ``pipeline``: ``DataPipeline`` (per rank) and ``Feed`` (per chunk), reader threads.
"""
from flodl_exp.rank.data.pipeline import DataPipeline, Delivered, Feed, build_pipeline

__all__ = ["DataPipeline", "Delivered", "Feed", "build_pipeline"]
