"""`duet bench serve`: load on any OpenAI-compatible server (duet, vLLM, llama.cpp's server), measured per request.

    workloads.py     what is sent: chat, multi-turn conversations, or a Mooncake trace as token-id prompts
    arrivals.py      when: Poisson arrivals (open loop); the trace's timestamps come with the trace
    stream_timer.py  one streamed response (SSE lines) -> its timings and token counts
    request_record.py  the per-request record every figure is computed from
    load.py          the load generator: asyncio + httpx, open loop (arrival times) or closed loop (N in flight)
    metrics.py       percentiles, goodput and SLO attainment: pure functions of the records
    report.py        the printed table and the JSON summary; plot.py the optional figure
"""
