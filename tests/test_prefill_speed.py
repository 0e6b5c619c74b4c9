"""PrefillSpeed (worker/prefill_speed.py): the speed a prefill worker reports to the router."""

import pytest

from worker.prefill_speed import DECAY, MIN_MEASURED_TOKENS, PrefillSpeed


def test_the_first_step_and_short_steps_are_not_measured():
    speed = PrefillSpeed()
    speed.observe(512, 10.0)  # warm-up: lazy loads, first allocations
    assert speed.tokens_per_s == 0.0  # unknown: the router uses the other workers' median
    speed.observe(MIN_MEASURED_TOKENS - 1, 5.0)  # a cache-hit follow-up: its time is the step's fixed cost
    assert speed.tokens_per_s == 0.0
    speed.observe(256, 0.5)
    assert speed.tokens_per_s == 512.0
    speed.observe(20, 3.0)  # one slow short step (a busy machine) leaves the estimate alone
    assert speed.tokens_per_s == 512.0


def test_the_speed_follows_recent_steps_by_decayed_sums():
    speed = PrefillSpeed()
    speed.observe(100, 1.0)
    speed.observe(100, 1.0)  # 100 tok/s
    speed.observe(1000, 1.0)  # 1000 tok/s now
    tokens, seconds = DECAY * 100 + 1000, DECAY * 1.0 + 1.0
    assert speed.tokens_per_s == pytest.approx(tokens / seconds)


def test_a_fresh_prefill_worker_reports_a_measured_speed_and_nothing_else_of_its_measurement(tiny_llama_dir):
    """A real cluster: the prefill worker times synthetic forwards before it serves (PrefillLoop.measure_speed),
    so its first heartbeat carries a speed and the router never prices it by the default; the measurement leaves
    no trace: every block free, no prefix-cache query, no KV event."""
    from cluster_helpers import worker_components, worker_stats

    from cluster.cluster_secret import load_cluster_secret
    from cluster.registry import WorkerRegistry
    from deploy.local_cluster import ClusterConfig, LocalCluster

    config = ClusterConfig(model_dir=str(tiny_llama_dir), worker_args=["--num-kv-blocks", "64"])
    with LocalCluster(config).start() as cluster:
        registry = WorkerRegistry.from_url(cluster.redis_url, cluster_secret=load_cluster_secret())
        (prefill,) = registry.list_workers(tiny_llama_dir.resolve().name, "prefill")
        assert prefill.load.prefill_tokens_per_s > 0
        (component,) = [c for c in worker_components(cluster) if c.name.startswith("prefill")]
        stats = worker_stats(component.address, "prefill")
        assert stats.integrity_error == "" and stats.num_free_blocks == stats.num_kv_blocks == 64
        assert (stats.prefix_query_tokens, stats.prefix_hit_tokens, stats.num_kv_events_published) == (0, 0, 0)
