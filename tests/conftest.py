import os

# Tests start worker processes (fork + exec) while gRPC threads run in this process. gRPC's fork support
# restarts its poller in the forked child, which can hit the fd that close_fds already closed and abort the
# child before exec (grpc/grpc#43055). Off before grpc is imported; it is only needed to keep grpc usable
# in a forked child that does not exec, which we never do.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
# One cluster secret for the session (cluster/cluster_secret.py: $DUET_CLUSTER_SECRET is its documented
# override): every cluster the tests start, and every in-process router or worker, runs the authenticated
# internal plane, and tests reach workers with it (cluster_helpers.internal_channel).
os.environ.setdefault("DUET_CLUSTER_SECRET", "tests-" + os.urandom(16).hex())

from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from engine.tiny_model import make_tiny_model

# `pytest tests/test_fuzz.py -s --hypothesis-profile=fuzz-soak`: the long random fuzz run (registered here, as
# the option is read before test modules are imported)
settings.register_profile("fuzz-soak", max_examples=1500, deadline=None, derandomize=False, database=None,
                          suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), arch="llama", layers=2, hidden=64, heads=4,
                           kv_heads=2, vocab=512, seed=0)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), arch="qwen2", layers=2, hidden=64, heads=4,
                           kv_heads=2, vocab=512, seed=1)


def shared_trace_path() -> Path:
    """The Mooncake trace from the project's shared data: $DUET_TRACE, ../shared next to the repo, or /work/shared."""
    repo = Path(__file__).resolve().parents[1]
    candidates = [Path(p) for p in [os.environ.get("DUET_TRACE")] if p] + [
        repo.parent / "shared" / "data" / "traces" / "mooncake_synthetic_trace.jsonl",
        Path("/work/shared/data/traces/mooncake_synthetic_trace.jsonl"),
    ]
    for path in candidates:
        if path.is_file():
            return path
    raise FileNotFoundError(f"the shared Mooncake trace is missing: looked at {[str(c) for c in candidates]}; "
                            "set DUET_TRACE to its path")
