"""`duet chat` as a user runs it: real subprocesses fed by a pipe, greedy answers compared exactly with
`LLM.chat` on the same history, offline and against a real local cluster."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from cluster_helpers import wait_idle

from deploy.local_cluster import ClusterConfig, LocalCluster
from engine import LLM, SamplingParams

MAX_TOKENS = 16
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
CHAT_FLAGS = ["--temperature", "0", "--max-tokens", str(MAX_TOKENS)]
FIRST, SECOND = "hello there", "and how are you today?"
# Long answers for Ctrl-C: the reply must still be streaming when the signal lands.
LONG_PARAMS = SamplingParams(max_tokens=160, temperature=0, ignore_eos=True)
LONG_FLAGS = ["--temperature", "0", "--max-tokens", "160", "--ignore-eos"]


def chat(*args, stdin: str = "", timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "duet", "chat", *map(str, args)], input=stdin, capture_output=True,
                          text=True, timeout=timeout, env=dict(os.environ))


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


@pytest.fixture(scope="module")
def offline(tiny_llama_dir):
    return LLM(tiny_llama_dir)


@pytest.fixture(scope="module")
def expected(offline):
    """Greedy answers for: FIRST; SECOND after FIRST's exchange; SECOND alone (what /reset must give)."""
    first = offline.chat([user(FIRST)], PARAMS)[0].outputs[0].text
    second = offline.chat([user(FIRST), assistant(first), user(SECOND)], PARAMS)[0].outputs[0].text
    fresh = offline.chat([user(SECOND)], PARAMS)[0].outputs[0].text
    assert second != fresh, "the history must change the answer, or this test could not see it kept"
    return first, second, fresh


def two_turns_and_reset() -> str:
    return f"{FIRST}\n{SECOND}\n/reset\n{SECOND}\n"


def test_offline_chat_keeps_history_and_reset_clears_it(tiny_llama_dir, expected):
    first, second, fresh = expected
    r = chat("--model", tiny_llama_dir, *CHAT_FLAGS, stdin=two_turns_and_reset())
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"{first}\n{second}\n{fresh}\n"  # no prompt marker on a pipe: exactly the answers
    assert "(history cleared)" in r.stderr


def test_system_message_starts_every_conversation_and_survives_reset(tiny_llama_dir, offline):
    system = {"role": "system", "content": "You are terse."}
    answer = offline.chat([system, user(FIRST)], PARAMS)[0].outputs[0].text
    assert answer != offline.chat([user(FIRST)], PARAMS)[0].outputs[0].text
    r = chat("--model", tiny_llama_dir, *CHAT_FLAGS, "--system", "You are terse.", stdin=f"{FIRST}\n/reset\n{FIRST}\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"{answer}\n{answer}\n"


def test_exit_command_leaves_before_the_rest_of_input(tiny_llama_dir, expected):
    r = chat("--model", tiny_llama_dir, *CHAT_FLAGS, stdin=f"{FIRST}\n\n/exit\n{SECOND}\n")
    assert (r.returncode, r.stdout) == (0, f"{expected[0]}\n"), r.stderr


def test_a_turn_too_long_for_the_context_is_refused_and_the_session_goes_on(tiny_llama_dir, expected):
    r = chat("--model", tiny_llama_dir, *CHAT_FLAGS, "--max-model-len", "64", stdin=f"{'word ' * 200}\n{SECOND}\n")
    assert r.returncode == 0, r.stderr
    assert "error: prompts[0].prompt" in r.stderr and "Traceback" not in r.stderr
    assert r.stdout == f"{expected[2]}\n"


def interrupted_session(args: list, first_line: str, second_line: str) -> tuple[str, str, int]:
    """Send `first_line`, Ctrl-C once its answer has started streaming, then `second_line` and end of input;
    (stdout, stderr, exit status)."""
    proc = subprocess.Popen([sys.executable, "-m", "duet", "chat", *map(str, args)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=0)
    out: list[str] = []
    started = threading.Event()

    def read() -> None:
        while ch := proc.stdout.read(1):
            out.append(ch)
            started.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc.stdin.write(first_line + "\n")
        proc.stdin.flush()
        assert started.wait(120), "no answer streamed"
        proc.send_signal(signal.SIGINT)
        time.sleep(0.2)
        proc.stdin.write(second_line + "\n")
        proc.stdin.close()
        rc = proc.wait(120)
        reader.join(10)
        return "".join(out), proc.stderr.read(), rc
    finally:
        if proc.poll() is None:
            proc.kill()


def assert_interrupted(stdout: str, stderr: str, rc: int, full: str, fresh: str) -> None:
    assert rc == 0, stderr
    assert "(stopped)" in stderr and "Traceback" not in stderr
    assert stdout.endswith(f"\n{fresh}\n")
    partial = stdout[: -len(fresh) - 2]
    assert full.startswith(partial) and len(partial) < len(full)  # stopped part way: a prefix of the answer


def test_ctrl_c_stops_the_answer_and_drops_the_turn(tiny_llama_dir, offline):
    full = offline.chat([user(FIRST)], LONG_PARAMS)[0].outputs[0].text
    fresh = offline.chat([user(SECOND)], LONG_PARAMS)[0].outputs[0].text  # the stopped turn is not in the history
    stdout, stderr, rc = interrupted_session(["--model", tiny_llama_dir, *LONG_FLAGS], FIRST, SECOND)
    assert_interrupted(stdout, stderr, rc, full, fresh)


@pytest.mark.parametrize("flags, message", [
    (["--temperature", "-1"], "temperature=-1.0 is invalid: must be >= 0"),
    (["--max-tokens", "lots"], "argument --max-tokens: invalid int value: 'lots'"),
    (["--logprobs", "2"], "unrecognized arguments: --logprobs 2"),
    (["--addr", "127.0.0.1:1", "--model", "m"], "--model only apply offline"),
    (["--addr", "127.0.0.1:1", "--num-kv-blocks", "64"], "--num-kv-blocks only apply offline"),
    (["--auth-token", "t"], "--auth-token and --tls-ca only apply with --addr"),
    (["--addr", "127.0.0.1:1", "--tls-ca", "/nonexistent/ca.pem"], "--tls-ca /nonexistent/ca.pem: no such file"),
])
def test_bad_flags_exit_2_naming_the_flag(flags, message):
    r = chat(*flags, stdin="hi\n")
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""


def test_unreachable_router_is_a_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free, and nothing listens once closed
    r = chat("--addr", f"127.0.0.1:{port}", stdin="hi\n", timeout=60)
    assert r.returncode == 1, r.stderr
    assert f"error: cannot reach the router at 127.0.0.1:{port}: UNAVAILABLE" in r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""


TOKEN = "chat-test-token"


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir):
    with LocalCluster(ClusterConfig(model_dir=str(tiny_llama_dir), router_args=["--auth-token", TOKEN])).start() as c:
        yield c


def remote(cluster) -> list[str]:
    return ["--addr", cluster.router_address, "--auth-token", TOKEN]


def test_remote_chat_gives_the_offline_answers(cluster, expected):
    first, second, fresh = expected
    r = chat(*remote(cluster), *CHAT_FLAGS, stdin=two_turns_and_reset())
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"{first}\n{second}\n{fresh}\n"
    wait_idle(cluster)


def test_remote_ctrl_c_cancels_the_request_on_every_worker(cluster, offline):
    full = offline.chat([user(FIRST)], LONG_PARAMS)[0].outputs[0].text
    fresh = offline.chat([user(SECOND)], LONG_PARAMS)[0].outputs[0].text
    stdout, stderr, rc = interrupted_session([*remote(cluster), *LONG_FLAGS], FIRST, SECOND)
    assert_interrupted(stdout, stderr, rc, full, fresh)
    wait_idle(cluster)  # the cancelled request left no block, request or reservation behind


def test_remote_wrong_token_is_a_clear_error(cluster):
    r = chat("--addr", cluster.router_address, "--auth-token", "wrong", *CHAT_FLAGS, stdin=f"{FIRST}\n{SECOND}\n")
    assert r.returncode == 1 and r.stdout == "", r.stderr
    assert (f"error: the router at {cluster.router_address} failed: UNAUTHENTICATED: missing or wrong bearer token"
            in r.stderr) and "Traceback" not in r.stderr
