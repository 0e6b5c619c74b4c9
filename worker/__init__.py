"""worker: what the prefill and the decode worker share, above cluster/ and below the two worker kinds.

    process.py        a worker process around its engine: gRPC, registry heartbeat, KV events, clean stop
    engine_thread.py  the one thread that owns the engine; other threads post calls to it
    metrics.py        a worker's Prometheus metrics (vLLM's names where the meaning is the same)
    tp_rank.py        what a tensor-parallel follower rank runs (each kind's tp_rank.py is its entry)
"""
