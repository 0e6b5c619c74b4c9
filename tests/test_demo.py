"""`duet demo`, the README's main command, as a user runs it: on the embedded SmolLM2-135M-Instruct."""

import os
import re
import subprocess
import sys

import pytest

LINE = re.compile(r"Q: (.*)\nA: (.*)\n   \[(\w+)\] prefill=(\S+) decode=(\S+) tokens=(\d+) "
                  r"cached_prompt_tokens=(\d+)/(\d+) ttft=[\d.]+ms")


@pytest.mark.slow
def test_demo_answers_on_the_default_model_and_routes_shared_prefixes_to_one_worker(tmp_path):
    env = dict(os.environ, DUET_CACHE_DIR=str(tmp_path / "cache"), TMPDIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "duet", "demo"], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert text.startswith("loading SmolLM2-135M-Instruct (Q4_1 GGUF) in 4 processes")
    assert "cluster ready" in text and text.rstrip().endswith("cluster stopped")
    answers = [(q, a, reason, prefill, decode, int(tokens), int(cached), int(prompt))
               for q, a, reason, prefill, decode, tokens, cached, prompt in LINE.findall(text)]
    assert len(answers) == 5, text
    assert all(reason == "stop" and 0 < tokens < 64 for _, _, reason, _, _, tokens, _, _ in answers), text  # EOS
    (q1, a1, _, w1, _, _, cached1, _), (_, _, _, w2, _, _, cached2, prompt2) = answers[:2]  # the two-turn chat
    assert q1 == "What is the capital of France?" and "Paris" in a1
    assert cached1 == 0 and w2 == w1 and 0 < cached2 < prompt2  # turn 2 reuses turn 1's blocks on its worker
    shared = answers[2:]
    assert shared[0][6] == 0
    for _, _, _, worker, _, _, cached, prompt in shared[1:]:  # the shared system prompt is served from one cache
        assert worker == shared[0][3] and 64 <= cached < prompt
    assert not list(tmp_path.glob("duet-cluster-*")), "temporary dirs left behind"
    assert not (tmp_path / "cache" / "models").exists(), "the tiny random model was built"
