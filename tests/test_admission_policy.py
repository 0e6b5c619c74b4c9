"""SLO-aware admission's pure parts (router/admission_policy.py, router/kv_transfer_rate.py,
router/ttft_correction.py) and the goodput
metrics (router/metrics.py): exact predictions, exact decisions at the boundaries, exact counts."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from cluster.registry import LiveWorker, WorkerInfo, WorkerLoad
from router.admission import Admission
from router.admission_policy import (
    AdmissionConfig,
    PrefillQueue,
    TTFTPrediction,
    decide,
    predict_local,
    predict_prefill,
    queued_tokens,
)
from router.kv_transfer_rate import DEFAULT_TOKENS_PER_S, KVTransferRate
from router.metrics import RouterMetrics
from router.ttft_correction import HALF_LIFE_S, MAX_CORRECTION, MIN_CORRECTION, TTFTCorrection

# round numbers: 10,000 prefill tokens/s, 100,000 transferred tokens/s, 10 ms fixed, SLO 100 ms
CONFIG = AdmissionConfig(slo_ttft_s=0.1, fixed_s=0.01, default_tokens_per_s=10_000.0)
TRANSFER = 100_000.0


def live_worker(worker_id: str) -> LiveWorker:
    return LiveWorker(WorkerInfo(worker_id, "prefill", "127.0.0.1:1", "m", block_size=16, num_kv_blocks=64),
                      WorkerLoad(), 0.0)


def queue(worker_id="p0", cached=0, inflight=0, reported=0, age_s=0.0, speed=10_000.0, awaiting=0):
    return PrefillQueue(worker_id, cached, inflight, awaiting, reported, age_s, speed)


def test_prediction_is_fixed_plus_queue_plus_uncached_prefill_plus_transfer():
    p = predict_prefill(600, [queue(cached=100, inflight=400)], TRANSFER, CONFIG)
    assert (p.worker_id, p.fixed_s, p.queue_s, p.prefill_s, p.transfer_s) == ("p0", 0.01, 0.04, 0.05, 0.005)
    assert p.ttft_s == pytest.approx(0.105) and p.idle_s == pytest.approx(0.065)


def test_the_best_worker_is_predicted_and_unknown_speeds_take_the_median():
    workers = [queue("slow", inflight=2_000), queue("cached", cached=500, inflight=300, speed=None),
               queue("fast", speed=20_000.0)]
    # "cached" runs at the known speeds' median, 15,000: 10 + 300/15 + 100/15 + 1 ms, under "fast"'s 10 + 30 + 6 ms
    p = predict_prefill(600, workers, TRANSFER, CONFIG)
    assert p.worker_id == "cached" and p.ttft_s == pytest.approx(0.01 + 0.02 + 0.1 / 15 + 0.001)
    cached = predict_prefill(600, workers[1:2], TRANSFER, CONFIG)  # alone, no speed known: the default
    assert cached.queue_s == pytest.approx(0.03) and cached.prefill_s == pytest.approx(0.01)


def test_a_stale_report_drains_at_the_workers_speed_and_is_not_added_to_the_routers_inflight_work():
    assert queued_tokens(queue(inflight=300, reported=1_000, age_s=0.05), 10_000.0) == 500  # 1000 - 0.05 s * 10k
    assert queued_tokens(queue(inflight=300, reported=1_000, age_s=0.08), 10_000.0) == 300  # the router's own
    assert queued_tokens(queue(inflight=0, reported=1_000, age_s=1.0), 10_000.0) == 0  # drained long ago


@pytest.mark.parametrize(("inflight", "admit", "retry_ms"), [
    (0, True, 0),          # idle: 10 + 50 + 5 = 65 ms
    (350, True, 0),        # 65 + 35 = 100 ms: exactly the SLO is met
    (351, False, 100),     # 100.1 ms: refused, the 0.1 ms wait raised to the 100 ms floor
    (2_350, False, 200),   # 300 ms: the queue must drain 200 ms
    (1_000_000, False, 30_000),  # capped
])
def test_refused_exactly_past_the_slo_with_the_wait_for_the_queue_to_drain(inflight, admit, retry_ms):
    decision = decide(predict_prefill(500, [queue(inflight=inflight)], TRANSFER, CONFIG), CONFIG)
    assert (decision.admit, decision.retry_after_ms) == (admit, retry_ms)


def test_a_request_that_misses_the_slo_even_on_an_idle_worker_is_served():
    # 1000 uncached tokens: 10 + 100 + 10 = 120 ms on an idle worker, over the SLO; the queue is not the reason
    huge = predict_prefill(1_000, [queue(inflight=5_000)], TRANSFER, CONFIG)
    assert huge.idle_s > CONFIG.slo_ttft_s and decide(huge, CONFIG).admit
    # the boundary: idle exactly at the SLO is refused once a queue pushes it past
    at_slo = TTFTPrediction("p0", 0.01, 0.001, 0.08, 0.01)
    assert at_slo.idle_s == pytest.approx(0.1) and not decide(at_slo, CONFIG).admit


def test_an_idle_cluster_never_refuses_and_no_slo_never_refuses():
    for prompt_tokens in (1, 100, 800, 10_000):
        p = predict_prefill(prompt_tokens, [queue(), queue("p1", speed=None)], TRANSFER, CONFIG)
        assert p.queue_s == 0 and decide(p, CONFIG).admit
    off = AdmissionConfig(slo_ttft_s=None, fixed_s=0.01)
    assert decide(predict_prefill(10, [queue(inflight=10**9)], TRANSFER, off), off).admit


def test_a_local_prefill_waits_behind_the_decode_workers_local_prefills_not_the_prefill_queue():
    """Conditional disaggregation: the decode worker's queue of local prefills (this router's in flight there, its
    reported waiting tokens, drained at the prefill workers' speed), no prefill worker's queue, no transfer."""
    prefills = [queue(inflight=10**6, speed=20_000.0)]
    p = predict_local(20, queue("d0", inflight=0, speed=None), prefills, CONFIG)
    assert (p.worker_id, p.queue_s, p.prefill_s, p.transfer_s, p.local) == ("d0", 0.0, 0.001, 0.0, True)
    assert decide(p, CONFIG).admit and "on decode worker d0 (local prefill)" in p.describe()
    # 3,000 tokens ahead there (a report 50 ms old of 4,000: 1,000 drained at 20,000/s) -> 150 ms: refused, 61 ms
    # over the SLO, the retry hint raised to min_retry_ms
    busy = predict_local(20, queue("d0", inflight=500, reported=4_000, age_s=0.05, speed=None), prefills, CONFIG)
    assert busy.queue_s == pytest.approx(0.15) and busy.idle_s == pytest.approx(0.011)
    assert (decide(busy, CONFIG).admit, decide(busy, CONFIG).retry_after_ms) == (False, CONFIG.min_retry_ms)


def test_the_correction_multiplies_the_model_and_judges_the_idle_part_too():
    # queue 100 ms + prefill 50 + transfer 5 + fixed 10 = 165 ms modelled; observed twice that lately
    p = predict_prefill(500, [queue(inflight=1_000)], TRANSFER, CONFIG, correction=2.0)
    assert (p.model_s, p.ttft_s, p.idle_s) == pytest.approx((0.165, 0.33, 0.13))
    assert "x 2.00 observed/modelled" in p.describe()
    # idle 65 ms x 2 = 130 ms > the 100 ms SLO: the request would miss it anyway, so it is served, not refused
    assert decide(p, CONFIG).admit
    # at x 1.5 the idle part (97.5 ms) meets the SLO and the queue makes it miss: refused, retry after 148 ms
    p = predict_prefill(500, [queue(inflight=1_000)], TRANSFER, CONFIG, correction=1.5)
    assert (decide(p, CONFIG).admit, decide(p, CONFIG).retry_after_ms) == (False, 148)
    with pytest.raises(ValueError, match="correction=0 is invalid: must be > 0"):
        TTFTPrediction("p0", 0.01, 0.0, 0.0, 0.0, correction=0)


def test_the_correction_is_the_time_decayed_ratio_of_observed_to_modelled_within_its_bounds():
    now = [0.0]
    c = TTFTCorrection(clock=lambda: now[0])
    assert c.value == 1.0  # nothing observed yet
    c.observe(0.2, 0.1)
    assert c.value == pytest.approx(2.0)
    now[0] = HALF_LIFE_S  # the first observation weighs half now: (0.5 * 0.2 + 0.1) / (0.5 * 0.1 + 0.1)
    c.observe(0.1, 0.1)
    assert c.value == pytest.approx(0.2 / 0.15)
    c.observe(0.0, 0.1)  # no measurement: ignored
    c.observe(0.1, 0.0)
    assert c.value == pytest.approx(0.2 / 0.15)
    now[0] += 100 * HALF_LIFE_S  # a ratio learnt long ago keeps its value until a new one outweighs it
    assert c.value == pytest.approx(0.2 / 0.15)
    c.observe(0.1, 0.1)
    assert c.value == pytest.approx(1.0)
    slow, fast = TTFTCorrection(), TTFTCorrection()
    slow.observe(100.0, 0.1)  # a restart's outlier cannot make admission refuse everything
    fast.observe(0.001, 0.1)
    assert (slow.value, fast.value) == (MAX_CORRECTION, MIN_CORRECTION)


def test_tokens_admitted_and_still_in_reserve_count_as_queued():
    # 3,000 uncached tokens admitted for p0 and not answered, 1,000 of them already sent to it: the larger counts
    assert queued_tokens(queue(inflight=1_000, awaiting=3_000), 10_000.0) == 3_000
    admission = Admission(CONFIG, RouterMetrics("m"))
    first = predict_prefill(3_000, [queue()], TRANSFER, CONFIG)
    with admission.awaiting_prefill(first):
        with admission.awaiting_prefill(predict_local(20, queue("d0"), [queue()], CONFIG)):  # the decode worker's
            p0, d0 = admission.queues([live_worker("p0"), live_worker("d0")], {}, None)
            assert (p0.awaiting_tokens, p0.inflight_tokens, d0.awaiting_tokens) == (3_000, 0, 20)
    # a request with nothing to prefill (all cached) counts nothing, and its answer, after the first request's,
    # finds nothing to take back (it once raised KeyError: the entry had gone with the first request's tokens)
    first_admitted = admission.awaiting_prefill(first)
    all_cached = admission.awaiting_prefill(predict_prefill(3_000, [queue(cached=3_000)], TRANSFER, CONFIG))
    first_admitted.__enter__()
    all_cached.__enter__()
    first_admitted.__exit__(None, None, None)
    all_cached.__exit__(None, None, None)
    assert admission._awaiting_tokens == {}
    (q,) = admission.queues([live_worker("p0")], {}, None)
    assert q.awaiting_tokens == 0 and admission._awaiting_tokens == {}  # answered: nothing left behind


def test_only_predictions_on_a_measured_speed_mark_it():
    measured = predict_prefill(500, [queue(speed=10_000.0)], TRANSFER, CONFIG)
    stand_in = predict_prefill(500, [queue(speed=None)], TRANSFER, CONFIG)  # the policy's default speed
    # a decode worker measures no prefill speed: a prefill worker's measured one stands in, and counts as measured
    local = predict_local(20, queue("d0", speed=None), [queue(speed=10_000.0)], CONFIG)
    local_guess = predict_local(20, queue("d0", speed=None), [queue(speed=None)], CONFIG)
    assert (measured.speed_measured, stand_in.speed_measured) == (True, False)
    assert (local.speed_measured, local_guess.speed_measured) == (True, False)
    # the decode worker's own measured speed for its local prefills wins once it has one: 5,000/s, 20 tokens = 4 ms
    own = predict_local(20, queue("d0", inflight=100, speed=5_000.0), [queue(speed=20_000.0)], CONFIG)
    assert (own.speed_measured, own.prefill_s, own.queue_s) == (True, pytest.approx(0.004), pytest.approx(0.02))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"slo_ttft_s": 0.0}, "slo_ttft_s=0.0 is invalid: must be > 0"),
    ({"fixed_s": -1.0}, "fixed_s=-1.0 is invalid: must be >= 0"),
    ({"default_tokens_per_s": 0.0}, "default_tokens_per_s=0.0 is invalid: must be > 0"),
    ({"min_retry_ms": 500, "max_retry_ms": 100}, "min_retry_ms=500, max_retry_ms=100 are invalid"),
])
def test_bad_config_names_the_field_and_the_range(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AdmissionConfig(**kwargs)


def test_transfer_rate_is_measured_from_replies_with_kv_and_decays():
    rate = KVTransferRate()
    assert rate.tokens_per_s == DEFAULT_TOKENS_PER_S
    rate.observe(0, 0.5)  # a decode-side cache hit: nothing crossed, nothing learnt
    rate.observe(1_000, -1.0)
    assert rate.tokens_per_s == DEFAULT_TOKENS_PER_S
    rate.observe(1_000, 0.01)
    assert rate.tokens_per_s == pytest.approx(100_000.0)
    rate.observe(1_000, 0.1)  # (0.9 * 1000 + 1000) / (0.9 * 0.01 + 0.1)
    assert rate.tokens_per_s == pytest.approx(1_900 / 0.109)
    with pytest.raises(ValueError, match="default_tokens_per_s=0 is invalid"):
        KVTransferRate(0)


def sample(metrics: RouterMetrics, name: str, **labels) -> float:
    value = metrics.registry.get_sample_value(name, {"model_name": "m", **labels})
    return 0.0 if value is None else value


def test_goodput_counts_requests_within_every_slo_set():
    metrics = RouterMetrics("m", slo_ttft_s=0.1, slo_tpot_s=0.02)
    metrics.first_token_sent(0.1, predicted_ttft_s=0.08)  # met (exactly), ratio 1.25
    metrics.request_completed("stop", e2e_s=0.3, ttft_s=0.1, num_output_tokens=11)  # tpot 20 ms: met -> good
    metrics.first_token_sent(0.2)  # missed
    metrics.request_completed("length", e2e_s=0.3, ttft_s=0.2, num_output_tokens=2)  # tpot 100 ms: missed
    metrics.first_token_sent(0.05)
    metrics.request_completed("stop", e2e_s=0.05, ttft_s=0.05, num_output_tokens=1)  # one token: tpot 0 -> good
    metrics.slo_refused()
    assert sample(metrics, "duet_router_slo_requests_total", slo="ttft", result="met") == 2
    assert sample(metrics, "duet_router_slo_requests_total", slo="ttft", result="missed") == 1
    assert sample(metrics, "duet_router_slo_requests_total", slo="tpot", result="met") == 2
    assert sample(metrics, "duet_router_slo_requests_total", slo="tpot", result="missed") == 1
    assert sample(metrics, "duet_router_good_requests_total") == 2
    assert sample(metrics, "duet_router_slo_rejected_requests_total") == 1
    assert sample(metrics, "duet_router_slo_ttft_seconds") == 0.1
    assert sample(metrics, "duet_router_ttft_prediction_ratio_count") == 1
    assert sample(metrics, "duet_router_ttft_prediction_ratio_bucket", le="1.25") == 1
    assert sample(metrics, "duet_router_ttft_prediction_ratio_bucket", le="1.1") == 0


def test_without_slos_every_completion_is_good_and_no_slo_series_exist():
    metrics = RouterMetrics("m")
    metrics.first_token_sent(5.0)
    metrics.request_completed("stop", e2e_s=9.0, ttft_s=5.0, num_output_tokens=3)
    assert sample(metrics, "duet_router_good_requests_total") == 1
    assert b"duet_router_slo_requests_total{" not in generate_latest(metrics.registry)
    assert sample(metrics, "duet_router_slo_ttft_seconds") == 0
