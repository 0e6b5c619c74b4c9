"""`duet bench serve`: its pure parts pinned exactly (percentiles, goodput and SLO attainment on hand-made records,
SSE timing, trace prompts' shared prefixes, seeded Poisson arrivals, argument errors), then the command against a
real cluster (redis, router with HTTP, a prefill and a decode worker) on the tiny model: chat, multiturn and a small
trace, every request completed with exactly max_tokens tokens, and every printed figure recomputed from the saved
records."""

from __future__ import annotations

import importlib.util
import json
import math
import socket
from pathlib import Path

import numpy as np
import pytest
from cluster_helpers import wait_idle
from conftest import shared_trace_path

from benchmarks.sim.trace_replay import TraceRequest, load_trace
from duet.bench_serve.arrivals import poisson_arrivals_s
from duet.bench_serve.metrics import SLO, latency_stats, summarize, throughput_bins
from duet.bench_serve.report import SUMMARY_KEYS, read_records
from duet.bench_serve.request_record import RequestRecord
from duet.bench_serve.stream_timer import StreamTimer
from duet.bench_serve.workloads import (
    FIRST_TRACE_TOKEN_ID,
    ChatSession,
    TraceBlocks,
    chat_sessions,
    multiturn_sessions,
)
from duet.cli_bench import main as bench_main

# -- metrics on hand-made records ------------------------------------------------------------------------------


def record(i: int, ok: bool = True, ttft_ms: float | None = 100.0, tpot_ms: float | None = 10.0,
           e2e_ms: float = 200.0, itl_ms: tuple[float, ...] = (), output_tokens: int = 11, start_s: float = 0.0
           ) -> RequestRecord:
    return RequestRecord(i, i, 0, 16, start_s=start_s, ok=ok, http_status=200 if ok else 503, ttft_ms=ttft_ms,
                         tpot_ms=tpot_ms, e2e_ms=e2e_ms, itl_ms=list(itl_ms), output_tokens=output_tokens)


def test_latency_stats_are_numpy_linear_percentiles():
    # rank p / 100 * (n - 1) into the sorted values 10, 20, 30, 40: 1.5 -> 25, 2.7 -> 37, 2.97 -> 39.7
    assert latency_stats([40.0, 10.0, 30.0, 20.0]) == pytest.approx({"p50": 25.0, "p90": 37.0, "p99": 39.7,
                                                                     "mean": 25.0}, rel=1e-12)
    assert latency_stats([7.0]) == {"p50": 7.0, "p90": 7.0, "p99": 7.0, "mean": 7.0}
    assert latency_stats([]) == {"p50": None, "p90": None, "p99": None, "mean": None}


def test_summary_goodput_and_slo_attainment_on_hand_made_records():
    records = [
        record(0, ttft_ms=100.0, tpot_ms=10.0, e2e_ms=200.0, itl_ms=(10.0, 20.0), output_tokens=11, start_s=0.0),
        record(1, ttft_ms=300.0, tpot_ms=10.0, e2e_ms=400.0, itl_ms=(30.0,), output_tokens=11, start_s=1.0),
        record(2, ttft_ms=100.0, tpot_ms=50.0, e2e_ms=600.0, itl_ms=(), output_tokens=11, start_s=2.0),
        record(3, ttft_ms=50.0, tpot_ms=None, e2e_ms=60.0, output_tokens=1, start_s=3.0),  # one token: no TPOT
        record(4, ok=False, ttft_ms=None, tpot_ms=None, e2e_ms=5.0, output_tokens=0, start_s=3.5),
    ]
    summary = summarize(records, SLO(ttft_ms=200.0, tpot_ms=20.0))
    assert list(summary) == list(SUMMARY_KEYS)
    assert (summary["requests"], summary["completed"], summary["failed"]) == (5, 4, 1)
    assert summary["duration_s"] == 3.505  # the last end, a failed request's included: 3.5 s + 5 ms
    assert summary["output_tokens_per_s"] == 34 / 3.505
    # sorted TTFTs 50, 100, 100, 300: p90 at rank 0.9 * 3 = 2.7 -> 100 + 0.7 * 200; p99 at 2.97 -> 100 + 0.97 * 200
    assert summary["ttft_ms"] == pytest.approx({"p50": 100.0, "p90": 240.0, "p99": 294.0, "mean": 137.5}, rel=1e-12)
    assert summary["tpot_ms"] == latency_stats([10.0, 10.0, 50.0])  # completed with >= 2 tokens
    assert summary["itl_ms"] == latency_stats([10.0, 20.0, 30.0])  # pooled gaps
    assert summary["e2e_ms"] == latency_stats([200.0, 400.0, 600.0, 60.0])
    # met: 0 and 3 (no TPOT meets the TPOT limit); 1 misses TTFT, 2 misses TPOT, 4 failed
    assert summary["goodput_rps"] == 2 / 3.505 and summary["slo_attainment"] == 2 / 5
    # only the limits given count; none given: every completed request meets it
    assert summarize(records, SLO(ttft_ms=200.0))["slo_attainment"] == 3 / 5
    assert summarize(records, SLO(tpot_ms=20.0))["slo_attainment"] == 3 / 5
    no_slo = summarize(records, SLO())
    assert no_slo["slo_attainment"] == 4 / 5 and no_slo["goodput_rps"] == 4 / 3.505


def test_every_request_failed_gives_null_latencies():
    summary = summarize([record(0, ok=False, ttft_ms=None, e2e_ms=2.0)], SLO())
    assert summary["completed"] == 0 and summary["ttft_ms"]["p50"] is None and summary["goodput_rps"] == 0.0
    assert summary["slo_attainment"] == 0.0


def test_throughput_bins_spread_a_requests_tokens_over_its_chunks():
    # chunks at 0.1, 0.6, 1.2 s carrying 9 tokens: 3 per chunk
    r = record(0, ttft_ms=100.0, itl_ms=(500.0, 600.0), output_tokens=9)
    assert throughput_bins([r, record(1, ok=False)]) == [6.0, 3.0]


# -- one stream, timed ---------------------------------------------------------------------------------------------


def sse(obj: dict | str) -> str:
    return "data: " + (obj if isinstance(obj, str) else json.dumps(obj))


def chat_chunk(content: str | None, finish_reason: str | None = None, role: bool = False) -> str:
    delta = {"role": "assistant", "content": content} if role else {"content": content}
    return sse({"choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}], "usage": None})


def test_stream_timer_times_text_chunks_and_counts_tokens_from_usage():
    timer = StreamTimer(chat=True, start_s=10.0, keep_text=True)
    lines = [(10.2, chat_chunk("", role=True)),  # the role chunk (duet sends it with the first token): not text
             (10.2, chat_chunk("Hel")), (10.2, ""), (10.25, ": keep-alive"),
             (10.3, chat_chunk("lo")), (10.3, chat_chunk("")),  # tokens whose text is held back: no chunk
             (10.6, chat_chunk(" world", "length")),
             (10.61, sse({"choices": [], "usage": {"prompt_tokens": 20, "completion_tokens": 5, "total_tokens": 25,
                                                   "prompt_tokens_details": {"cached_tokens": 16}}})),
             (10.62, sse("[DONE]"))]
    for now_s, line in lines:
        timer.feed(line, now_s)
    r = RequestRecord(0, 0, 0, 5, http_status=200)
    timer.fill(r, 10.7)
    assert timer.text == "Hello world"
    assert (r.ok, r.error, r.finish_reason) == (True, None, "length")
    assert (r.ttft_ms, r.e2e_ms, r.itl_ms) == (200.0, 700.0, [100.0, 300.0])
    assert (r.output_tokens, r.output_tokens_from, r.text_chunks) == (5, "usage", 3)
    assert (r.prompt_tokens, r.cached_tokens) == (20, 16)
    assert r.tpot_ms == 125.0  # (700 - 200) / (5 - 1)


def test_stream_timer_without_usage_counts_chunks_and_errors_fail_the_request():
    timer = StreamTimer(chat=False, start_s=0.0)
    for now_s, text in ((0.5, "a"), (0.75, "b")):
        timer.feed(sse({"choices": [{"index": 0, "text": text, "finish_reason": None}]}), now_s)
    timer.feed(sse("[DONE]"), 0.8)
    r = RequestRecord(0, 0, 0, 2, http_status=200)
    timer.fill(r, 1.0)
    assert (r.ok, r.output_tokens, r.output_tokens_from, r.ttft_ms, r.tpot_ms) == (True, 2, "chunks", 500.0, 500.0)
    assert r.prompt_tokens is None and r.cached_tokens is None

    broken = StreamTimer(chat=False, start_s=0.0)
    broken.feed(sse({"choices": [{"index": 0, "text": "a"}]}), 0.1)
    broken.feed(sse({"error": {"message": "worker lost", "type": "service_unavailable"}}), 0.2)
    r = RequestRecord(0, 0, 0, 2, http_status=200)
    broken.fill(r, 0.3)
    assert (r.ok, r.error) == (False, "error event: worker lost")

    cut = StreamTimer(chat=False, start_s=0.0)
    cut.feed(sse({"choices": [{"index": 0, "text": "a"}]}), 0.1)
    r = RequestRecord(0, 0, 0, 2, http_status=200)
    cut.fill(r, 0.3)
    assert (r.ok, r.error) == (False, "the stream ended without 'data: [DONE]'")


# -- workloads -------------------------------------------------------------------------------------------------


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def common_blocks(a: TraceRequest, b: TraceRequest) -> int:
    return common_prefix(list(a.hash_ids), list(b.hash_ids))


def trace_request(i: int, prompt_tokens: int, hash_ids: tuple[int, ...]) -> TraceRequest:
    return TraceRequest(i, 0.0, prompt_tokens, 4, hash_ids)


def test_trace_prompts_share_exactly_the_shared_hash_id_prefix():
    blocks = TraceBlocks(block_tokens=16, vocab_size=512, seed=0)
    a = trace_request(0, 1300, (1, 2, 3))  # 2 full trace blocks + 276 tokens: 16 + 16 + ceil(276 / 32) = 41 tokens
    b = trace_request(1, 1536, (1, 2, 4))
    c = trace_request(2, 600, (1, 5))
    ids = {r.request_index: blocks.prompt_token_ids(r) for r in (a, b, c)}
    assert [len(ids[i]) for i in range(3)] == [41, 48, 16 + 3]
    assert common_prefix(ids[0], ids[1]) == 32 and common_prefix(ids[0], ids[2]) == 16
    assert all(FIRST_TRACE_TOKEN_ID <= t < 512 for t in ids[0] + ids[1] + ids[2])
    # the same block id, the same tokens, in any run with the same seed; another seed, other tokens
    assert TraceBlocks(16, 512, seed=0).prompt_token_ids(b) == ids[1]
    assert TraceBlocks(16, 512, seed=1).prompt_token_ids(b) != ids[1]
    # at the trace's own block size a prompt has exactly input_length tokens
    assert len(TraceBlocks(512, 32000, seed=0).prompt_token_ids(a)) == 1300


def test_real_trace_prompts_share_exactly_their_hash_id_prefixes():
    requests = load_trace(shared_trace_path())
    blocks = TraceBlocks(block_tokens=16, vocab_size=32000, seed=0)
    ids = [blocks.prompt_token_ids(r) for r in requests]
    by_first_block: dict[int, list[int]] = {}
    for i, r in enumerate(requests):
        by_first_block.setdefault(r.hash_ids[0], []).append(i)
    # prompts with different first blocks differ at their first token
    assert len({ids[group[0]][0] for group in by_first_block.values()}) == len(by_first_block)
    pairs = 0
    for group in by_first_block.values():
        for n, i in enumerate(group):
            for j in group[n + 1:]:
                k = common_blocks(requests[i], requests[j])
                # k shared blocks: k * 16 tokens, less where one prompt ends inside them (its last block is partial)
                assert common_prefix(ids[i], ids[j]) == min(len(ids[i]), len(ids[j]), k * 16), (i, j, k)
                pairs += 1
    assert pairs == 7230  # the trace shares prefixes


def test_multiturn_sends_the_history_with_the_answers_given():
    [session] = multiturn_sessions(num_conversations=1, turns=3, system_prompt_words=30, max_tokens=8, seed=0)
    assert isinstance(session, ChatSession) and session.num_turns == 3 and session.needs_answers
    first = session.request(0).payload["messages"]
    assert [m["role"] for m in first] == ["system", "user"] and len(first[0]["content"].split()) == 30
    session.add_answer("answer one")
    second = session.request(1).payload["messages"]
    assert second[:2] == first and second[2] == {"role": "assistant", "content": "answer one"}
    assert [m["role"] for m in second] == ["system", "user", "assistant", "user"]
    assert second[3]["content"] != first[1]["content"]


def test_per_session_system_prompts_differ_after_the_instruction_and_are_seeded():
    """--system-prompt per-session: each conversation's system prompt shares only the 12-word instruction with the
    others'; the shared default gives every session the same one."""
    def systems(shared: bool, seed: int = 0) -> list[str]:
        sessions = multiturn_sessions(num_conversations=3, turns=2, system_prompt_words=300, max_tokens=8, seed=seed,
                                      shared=shared)
        return [session.request(0).payload["messages"][0]["content"] for session in sessions]

    shared, own = systems(True), systems(False)
    assert len(set(shared)) == 1 and len(set(own)) == 3 and own == systems(False)
    assert own != systems(False, seed=1) and all(len(s.split()) == 300 for s in own)
    assert len({" ".join(s.split()[12:15]) for s in own}) == 3  # they part right after the instruction
    assert all(s.startswith("You are a helpful assistant. Answer the question in a few sentences. ") for s in own)
    chats = chat_sessions(3, 40, 8, seed=0, shared=False)
    assert len({c.request(0).payload["messages"][0]["content"] for c in chats}) == 3


def test_poisson_arrivals_are_seeded_and_have_the_rate():
    a = poisson_arrivals_s(2000, rate_per_s=4.0, seed=7)
    assert a == poisson_arrivals_s(2000, rate_per_s=4.0, seed=7)
    assert a != poisson_arrivals_s(2000, rate_per_s=4.0, seed=8)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:]))
    assert 0.9 * 0.25 < np.mean(np.diff(a)) < 1.1 * 0.25
    assert poisson_arrivals_s(3, math.inf, seed=0) == [0.0, 0.0, 0.0]
    assert poisson_arrivals_s(0, 1.0, seed=0) == []


# -- argument errors (nothing is sent: the server need not exist) ------------------------------------------------

URL = ["--url", "http://127.0.0.1:9"]


@pytest.mark.parametrize("argv, message", [
    ([], "--workload chat needs exactly one of --request-rate R (open loop, Poisson) or --concurrency N "
         "(closed loop), got neither"),
    (["--request-rate", "2", "--concurrency", "2"], "got --request-rate and --concurrency"),
    (["--workload", "multiturn", "--concurrency", "2", "--num-requests", "5"],
     "--num-requests 5 does not apply to --workload multiturn: it is for chat and trace"),
    (["--concurrency", "2", "--turns", "3"], "--turns 3 does not apply to --workload chat: it is for multiturn"),
    (["--workload", "trace", "t.jsonl", "--system-prompt", "per-session"],
     "--system-prompt per-session does not apply to --workload trace: it is for chat and multiturn"),
    (["--workload", "story", "--concurrency", "2"], "--workload 'story' is invalid: choose chat, multiturn or trace"),
    (["--workload", "trace"], "--workload trace needs exactly one FILE"),
    (["--workload", "chat", "x.jsonl", "--concurrency", "1"], "--workload chat takes no argument, got 'x.jsonl'"),
    (["--workload", "trace", "t.jsonl", "--request-rate", "1", "--time-scale", "0.5"],
     "--time-scale 0.5 scales the trace's timestamps, which --request-rate replaces"),
    (["--workload", "trace", "t.jsonl", "--trace-block-tokens", "1024"],
     "--trace-block-tokens 1024 is invalid: must be in [1, 512]"),
    (["--workload", "trace", "t.jsonl", "--vocab-size", "50"], "--vocab-size 50 is invalid: must be > 100"),
    (["--concurrency", "1", "--temperature", "-1"], "--temperature -1.0 is invalid: must be a finite number >= 0"),
    (["--concurrency", "1", "--json", "/no/such/dir/out.json"], "--json /no/such/dir/out.json is invalid: no "
                                                                 "directory /no/such/dir"),
    (["--workload", "trace", "/no/such/trace.jsonl"], "cannot read trace /no/such/trace.jsonl"),
])
def test_argument_errors_name_the_flag_and_exit_2(capsys, argv, message):
    assert bench_main(["bench", "serve", *URL, *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--concurrency", "0"], "argument --concurrency: 0 is invalid: must be > 0"),
    (["--request-rate", "-1"], "argument --request-rate: -1 is invalid: must be > 0 requests/s"),
    (["--max-tokens", "x"], "argument --max-tokens: 'x' is not a int"),
])
def test_flag_values_are_judged_by_argparse(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        bench_main(["bench", "serve", *URL, *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_bad_url_and_missing_matplotlib_are_errors(capsys, monkeypatch, tmp_path):
    assert bench_main(["bench", "serve", "--url", "127.0.0.1:8000", "--concurrency", "1"]) == 2
    assert "--url '127.0.0.1:8000' is invalid: must be http://HOST:PORT" in capsys.readouterr().err
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a))
    assert bench_main(["bench", "serve", *URL, "--concurrency", "1", "--plot", str(tmp_path / "p.png")]) == 2
    assert "--plot needs matplotlib, which is not installed: pip install 'duet[plot]'" in capsys.readouterr().err


def closed_port_url() -> str:
    with socket.socket() as s:  # a port nothing listens on (bound, then released)
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_unreachable_server_fails_requests_not_the_command(capsys, tmp_path):
    from duet.cli import main

    url = closed_port_url()
    out = tmp_path / "down.json"
    assert main(["bench", "serve", "--url", url, "--model", "m", "--workload", "multiturn", "--num-conversations",
                 "1", "--turns", "2", "--concurrency", "1", "--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert (summary["requests"], summary["completed"], summary["failed"]) == (2, 0, 2)
    first, second = summary["records"]
    assert first["http_status"] is None and first["error"].startswith("ClientConnectorError")
    assert second["start_s"] is None and second["error"] == "not sent: turn 0 of its session failed"
    assert "warning: 2 of 2 requests failed; the first, request 0: ClientConnectorError" in capsys.readouterr().err
    # without --model the command asks GET /v1/models first: that failing ends it (status 1)
    assert main(["bench", "serve", "--url", url, "--concurrency", "1"]) == 1
    assert f"cannot list the served models at {url}/v1/models: ClientConnectorError" in capsys.readouterr().err


def test_proxy_variables_are_honoured(monkeypatch, tmp_path):
    """As with curl or httpx, HTTP_PROXY routes the requests (here to a proxy that is down: the requests fail there)."""
    from duet.cli import main

    for name in ("NO_PROXY", "no_proxy", "http_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTP_PROXY", closed_port_url())
    out = tmp_path / "proxied.json"
    assert main(["bench", "serve", "--url", closed_port_url(), "--model", "m", "--num-requests", "1",
                 "--concurrency", "1", "--json", str(out)]) == 0
    (record,) = json.loads(out.read_text())["records"]
    assert record["error"].startswith("ClientProxyConnectionError"), record["error"]


# -- against a real cluster ------------------------------------------------------------------------------------

MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir):
    from deploy.local_cluster import ClusterConfig, LocalCluster

    config = ClusterConfig(model_dir=str(tiny_llama_dir),
                           worker_args=["--num-kv-blocks", "256", "--max-model-len", str(MAX_MODEL_LEN)],
                           router_args=["--max-model-len", str(MAX_MODEL_LEN)], http_port=0)
    with LocalCluster(config).start() as c:
        yield c


def run_serve(cluster, tmp_path: Path, name: str, argv: list[str]) -> tuple[dict, list[RequestRecord]]:
    """Run the command in-process; its --json object and its --records (which must agree)."""
    from duet.cli import main

    out_json, out_records = tmp_path / f"{name}.json", tmp_path / f"{name}.jsonl"
    assert main(["bench", "serve", "--url", cluster.http_url, *argv, "--json", str(out_json),
                 "--records", str(out_records)]) == 0
    summary = json.loads(out_json.read_text())
    records = read_records(out_records)
    assert [RequestRecord.from_json(r) for r in summary["records"]] == records
    return summary, records


def assert_recomputable(summary: dict, records: list[RequestRecord]) -> None:
    """Every figure of the summary, recomputed from the saved records alone, independently of metrics.py."""
    done = [r for r in records if r.ok]
    populations = {"ttft_ms": [r.ttft_ms for r in done], "tpot_ms": [r.tpot_ms for r in done if r.tpot_ms is not None],
                   "itl_ms": [g for r in done for g in r.itl_ms], "e2e_ms": [r.e2e_ms for r in done]}
    for key, values in populations.items():
        assert summary[key] == {"p50": float(np.percentile(values, 50)), "p90": float(np.percentile(values, 90)),
                                "p99": float(np.percentile(values, 99)), "mean": float(np.mean(values))}, key
    duration_s = max(r.start_s + r.e2e_ms / 1000 for r in records)
    assert summary["duration_s"] == duration_s
    assert summary["output_tokens_per_s"] == sum(r.output_tokens for r in done) / duration_s
    assert summary["goodput_rps"] == len(done) / duration_s and summary["slo_attainment"] == len(done) / len(records)


def test_chat_multiturn_and_trace_against_a_cluster(cluster, tmp_path, capsys, tiny_llama_dir):
    summary, records = run_serve(cluster, tmp_path, "chat", [
        "--workload", "chat", "--num-requests", "6", "--concurrency", "2", "--max-tokens", "8",
        "--system-prompt-tokens", "20", "--plot", str(tmp_path / "chat.png")])
    printed = capsys.readouterr().out
    assert list(summary) == [*SUMMARY_KEYS, "config", "records"]
    assert (summary["requests"], summary["completed"], summary["failed"]) == (6, 6, 0)
    assert all(r.output_tokens == 8 and r.output_tokens_from == "usage" and r.finish_reason == "length"
               for r in records)
    assert all(r.scheduled_s is None for r in records)  # closed loop
    assert sum(r.cached_tokens > 0 for r in records) >= 4  # the shared system prompt is reused
    assert_recomputable(summary, records)
    assert f"| 6 | 6 | 0 | {summary['duration_s']:.2f} |" in printed
    assert f"| TTFT | {summary['ttft_ms']['p50']:.2f} | {summary['ttft_ms']['p90']:.2f} |" in printed
    assert summary["config"]["model"] == tiny_llama_dir.name  # asked of GET /v1/models
    assert (tmp_path / "chat.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    summary, records = run_serve(cluster, tmp_path, "multiturn", [
        "--workload", "multiturn", "--num-conversations", "2", "--turns", "3", "--max-tokens", "8",
        "--system-prompt-tokens", "10", "--request-rate", "inf", "--slo-ttft-ms", "60000"])
    assert (summary["requests"], summary["completed"], summary["failed"]) == (6, 6, 0)
    assert [(r.session_index, r.turn) for r in records] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert all(r.output_tokens == 8 for r in records)
    for conversation in (records[:3], records[3:]):  # each turn sends the history: the prompt grows
        prompts = [r.prompt_tokens for r in conversation]
        assert prompts[0] < prompts[1] < prompts[2], prompts
        for before, after in zip(conversation, conversation[1:]):  # the next turn starts after the answer
            assert after.start_s >= before.start_s + before.e2e_ms / 1000
    assert records[0].scheduled_s == records[3].scheduled_s == 0.0  # rate inf: every conversation at once
    assert_recomputable(summary, records)

    trace = tmp_path / "trace.jsonl"
    lines = [{"timestamp": 0, "input_length": 1300, "output_length": 5, "hash_ids": [1, 2, 3]},
             {"timestamp": 50, "input_length": 1536, "output_length": 7, "hash_ids": [1, 2, 4]},
             {"timestamp": 120, "input_length": 600, "output_length": 40, "hash_ids": [1, 5]}]
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    summary, records = run_serve(cluster, tmp_path, "trace", [
        "--workload", "trace", str(trace), "--trace-block-tokens", "16", "--vocab-size", "512", "--max-tokens", "30",
        "--time-scale", "2"])
    assert (summary["requests"], summary["completed"], summary["failed"]) == (3, 3, 0)
    assert [r.prompt_tokens for r in records] == [41, 48, 19]
    assert [r.output_tokens for r in records] == [5, 7, 30]  # output_length, capped by --max-tokens
    assert [r.scheduled_s for r in records] == [0.0, 0.1, 0.24]  # timestamps x --time-scale
    assert records[1].cached_tokens >= 32  # two shared blocks: request 1 reuses request 0's prefix
    assert_recomputable(summary, records)

    # a refusal is a failed request: prompts past the context are 400s, counted, and the command still reports
    summary, records = run_serve(cluster, tmp_path, "too-long", [
        "--num-requests", "2", "--concurrency", "2", "--system-prompt-tokens", str(MAX_MODEL_LEN)])
    assert (summary["completed"], summary["failed"], summary["ttft_ms"]["p50"]) == (0, 2, None)
    assert all(r.http_status == 400 and "max_model_len=512" in r.error for r in records)
    wait_idle(cluster)  # nothing left behind on the workers
