"""EngineConfig, the one source of engine settings: JSON round trip, flags round trip, the followers' argument."""

import argparse
import dataclasses
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from duet.cli_common import add_engine_args, engine_config
from engine.engine_config import DEVICES, DTYPE_ALIASES, DTYPE_NAMES, ENGINE_FLAGS, EngineConfig
from engine.tp_worker import engine_arg_parser

# Settings with no command-line flag: set in code (LLM(...) keyword arguments) or, for model_id, by the
# worker commands' own --model-id; they still travel to TP followers in the JSON.
UNFLAGGED = {"kv_cache_bytes", "max_logprobs", "seed", "model_id", "fast_linears"}

maybe = st.none() | st.integers(1, 1 << 20)
flag_settings = st.fixed_dictionaries({
    "dtype": st.none() | st.sampled_from(DTYPE_NAMES + tuple(DTYPE_ALIASES)),
    "block_size": st.integers(1, 1024),
    "num_kv_blocks": maybe,
    "max_num_seqs": st.integers(1, 4096),
    "max_num_batched_tokens": st.integers(1, 1 << 16),
    "max_model_len": st.none() | st.integers(2, 1 << 20),
    "enable_prefix_caching": st.booleans(),
    "num_threads": maybe,
    "tp_size": st.integers(1, 8),
    "device": st.sampled_from(DEVICES),
    "cuda_graphs": st.booleans(),
    "cuda_graph_batch_sizes": st.none() | st.lists(st.integers(1, 512), min_size=1, max_size=6).map(tuple),
    "kv_cache_memory_fraction": st.none() | st.floats(0, 1, exclude_min=True),
}).filter(lambda s: s["num_kv_blocks"] is None or s["kv_cache_memory_fraction"] is None)  # one sizes the cache
other_settings = st.fixed_dictionaries({
    "kv_cache_bytes": st.integers(1, 1 << 40),
    "max_logprobs": st.integers(0, 100),
    "seed": st.integers(0, 2**63 - 1),
    "model_id": st.none() | st.text(max_size=20),
    "fast_linears": st.booleans(),
})


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p


def test_every_setting_has_a_flag_or_is_named_here():
    flagged = [f.field for f in ENGINE_FLAGS]
    assert len(flagged) == len(set(flagged))
    assert set(flagged) | UNFLAGGED == {f.name for f in dataclasses.fields(EngineConfig)}
    assert not set(flagged) & UNFLAGGED


@given(flag_settings, other_settings)
def test_json_round_trip(flagged, other):
    config = EngineConfig(**flagged, **other)
    assert EngineConfig.from_json(config.to_json()) == config


@given(flag_settings)
def test_flags_round_trip(settings):
    config = EngineConfig(**settings)
    argv = config.to_flags()
    assert engine_config(parser().parse_args(argv)) == config
    flags = [a for a in argv if a.startswith("--")]
    assert len(flags) == len(set(flags))  # each setting spelled once


def test_existing_flags_keep_their_names_and_meaning():
    args = parser().parse_args([
        "--model", "/m", "--dtype", "bf16", "--block-size", "8", "--num-kv-blocks", "64", "--max-num-seqs", "4",
        "--max-num-batched-tokens", "256", "--max-model-len", "512", "--no-prefix-caching", "--threads", "2",
        "--tp", "2", "--device", "auto", "--no-cuda-graphs", "--cuda-graph-batch-sizes", "1, 2,4"])
    assert str(args.model) == "/m"
    assert engine_config(args, model_id="m") == EngineConfig(
        dtype="bf16", block_size=8, num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=256, max_model_len=512,
        enable_prefix_caching=False, num_threads=2, tp_size=2, device="auto", cuda_graphs=False,
        cuda_graph_batch_sizes=(1, 2, 4), model_id="m")
    assert engine_config(parser().parse_args([])) == EngineConfig()
    assert EngineConfig().to_flags() == []
    assert EngineConfig(block_size=8, tp_size=2, enable_prefix_caching=False).to_flags() == [
        "--block-size", "8", "--no-prefix-caching", "--tp", "2"]


def test_bad_flag_values_are_usage_errors(capsys):
    for argv, message in ((["--cuda-graph-batch-sizes", "0,2"], "--cuda-graph-batch-sizes='0,2' is invalid"),
                          (["--device", "tpu"], "invalid choice: 'tpu'"),
                          (["--block-size", "x"], "invalid int value: 'x'")):
        with pytest.raises(SystemExit):
            parser().parse_args(argv)
        assert message in capsys.readouterr().err


def test_a_setting_without_a_flag_is_not_dropped_from_flags():
    with pytest.raises(ValueError, match="seed=3 has no command-line flag"):
        EngineConfig(seed=3).to_flags()


def test_from_json_names_what_is_wrong():
    with pytest.raises(ValueError, match="engine config fields bogus are unknown"):
        EngineConfig.from_json('{"block_size": 8, "bogus": 1}')
    with pytest.raises(ValueError, match="is not JSON"):
        EngineConfig.from_json("{")
    with pytest.raises(ValueError, match="must be a JSON object"):
        EngineConfig.from_json("[1]")
    with pytest.raises(ValueError, match="block_size=0 is invalid"):
        EngineConfig.from_json('{"block_size": 0}')


def test_followers_take_resolved_settings_as_one_json_argument(capsys):
    resolved = EngineConfig(dtype="bfloat16", block_size=8, num_kv_blocks=40, max_model_len=256, num_threads=2,
                            fast_linears=False, device="cpu", tp_size=2)
    base = ["--rank", "1", "--size", "2", "--init-method", "tcp://127.0.0.1:1", "--model", "/m"]
    args = engine_arg_parser().parse_args([*base, "--engine-config", resolved.to_json()])
    assert (args.rank, args.size, args.model, args.engine_config) == (1, 2, "/m", resolved)
    for config, message in ((dataclasses.replace(resolved, num_kv_blocks=None), "num_kv_blocks must be resolved"),
                            (dataclasses.replace(resolved, device="auto"), "device='auto' must be resolved")):
        with pytest.raises(SystemExit):
            engine_arg_parser().parse_args([*base, "--engine-config", config.to_json()])
        assert message in capsys.readouterr().err


def test_building_the_command_line_imports_no_torch():
    code = ("import sys, duet.cli\nduet.cli.build_parser()\n"
            "assert 'torch' not in sys.modules, 'heavy import'")
    subprocess.run([sys.executable, "-c", code], check=True)
