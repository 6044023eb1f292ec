"""End-to-end benchmark of an OpenAI-compatible endpoint, with ``vllm bench serve``'s metrics.

- ``client``: the load generator (threads, one reused connection each, arrival timestamps)
- ``metrics``: per-request metrics from event timelines, run summaries
- ``sweep``: a run over concurrency levels or request rates -> the JSON document; baseline gate
- ``report``: console tables; ``plot``: the four-panel PNG; ``compare``: regression check
- ``perf``: the accuracy benchmark against the engine stand-in (``nox -s perf -- bench``)
"""
