"""`duet bench serve`: load on any OpenAI-compatible server (duet, vLLM, llama.cpp's server), measured per request.

    config.py          the command's flags, judged once, as one dataclass
    workloads.py       what is sent: chat, multi-turn conversations, or a Mooncake trace as token-id prompts
    arrivals.py        when, in an open loop: Poisson arrivals (a trace brings its own timestamps)
    load.py            the load generator: aiohttp on uvloop, open loop (arrival times) or closed loop (N in flight)
    stream_timer.py    one streamed response (SSE lines) -> its timings and token counts
    request_record.py  the per-request record every figure is computed from (what a chunk, ITL and TPOT are)
    metrics.py         percentiles, goodput and SLO attainment: pure functions of the records
    report.py          the printed table, the JSON summary, the records file; plot.py the optional figure
"""
