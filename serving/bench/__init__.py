"""``pxrt bench``: load tests that measure pxrt against what a user would otherwise do.

- ``loadgen``: closed- and open-loop load on the event loop, loop lag, result rows;
- ``baselines``: the ceiling, a plain asyncio batcher, the null batcher, the naive way;
- ``inprocess``: the in-process run of ``pxrt bench MODEL_DIR``;
- ``http``: the same over HTTP against a running server (``pxrt bench --url``);
- ``report``: the table, summary ratios, bench.json and bench.png;
- ``command``: the command line.
"""
