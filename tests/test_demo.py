"""`duet demo`, the README's main command, as a user runs it (on a fresh embedded model)."""

import os
import re
import subprocess
import sys


def test_demo_runs_the_cluster_and_routes_shared_prefixes_to_one_worker(tmp_path):
    env = dict(os.environ, DUET_CACHE_DIR=str(tmp_path / "cache"), TMPDIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "duet", "demo", "--max-tokens", "6"], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert "cluster ready" in text and text.rstrip().endswith("cluster stopped")
    answers = re.findall(r"\[(\w+)\] prefill=(\S+) tokens=(\d+) cached_prompt_tokens=(\d+)/(\d+)", text)
    assert len(answers) == 5
    assert all(reason == "length" and tokens == "6" for reason, _, tokens, _, _ in answers)
    first_worker = answers[0][1]
    assert answers[0][3] == "0"
    for _, worker, _, cached, prompt in answers[1:]:  # the shared system prompt is served from one cache
        assert worker == first_worker and int(cached) >= 64 and int(cached) < int(prompt)
    assert not list(tmp_path.glob("duet-cluster-*")), "temporary dirs left behind"
