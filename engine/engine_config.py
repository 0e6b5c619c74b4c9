"""Engine settings: `EngineConfig`, the one source of them, and their one command-line spelling.

`ENGINE_FLAGS` says which field each flag sets; `add_engine_flags`, `EngineConfig.from_flags` and
`EngineConfig.to_flags` are generated from it (a command adds the flags, parses them into a config, or
spells a config back as flags for a child process). A process hands fully resolved settings to another
as one JSON document (`to_json` / `from_json`): that is how tensor-parallel followers get theirs.

No torch here: the router and the client build the command line without importing it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from dataclasses import dataclass

from engine.speculative_config import SpeculativeConfig, json_object

DTYPE_NAMES = ("float32", "float16", "bfloat16")
DTYPE_ALIASES = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16", "float": "float32"}
DEVICES = ("cpu", "cuda", "auto")
# How linear weights are held (engine/quantization.py): auto = a GGUF file's Q4_0/Q4_1/Q8_0 kept as stored, a
# dense checkpoint dense; none = dense in the engine dtype; int8 / int4 = round-to-nearest on load.
QUANTIZATIONS = ("auto", "none", "int8", "int4")
# What quantized linears multiply their weights with on CPU: float = x as it is (results equal the dequantized
# model's up to fp32 summation order); int8 = x rounded per 32 inputs to int8, integer dot products (llama.cpp's
# way: ~1.2-1.4x faster kernels, benchmarks/RESULTS.md, at the price of that rounding).
QUANTIZED_ACTIVATIONS = ("float", "int8")


def canonical_dtype(name: str) -> str:
    """float32, float16 or bfloat16 for a dtype name or alias; ValueError naming the allowed ones."""
    key = DTYPE_ALIASES.get(name, name)
    if key not in DTYPE_NAMES:
        raise ValueError(f"dtype={name!r} is invalid: must be one of {', '.join(DTYPE_NAMES)} (or fp32/fp16/bf16)")
    return key


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings. Each flag of `ENGINE_FLAGS` sets one field; the fields without a flag are set in code
    (`LLM(..., seed=1)`) or by a command's own flag (--model-id). Every field travels in `to_json`."""

    dtype: str | None = None  # None: the checkpoint's dtype
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: as many as kv_cache_bytes holds, capped by need
    kv_cache_bytes: int = 2 * 1024**3  # the KV cache's budget unless kv_cache_memory_fraction is set
    # fraction of the device's memory this engine may fill with weights + KV cache; the KV cache gets the rest of
    # it after the weights (engine/memory_budget.py; vLLM's gpu_memory_utilization). None: kv_cache_bytes
    kv_cache_memory_fraction: float | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    max_logprobs: int = 20
    seed: int = 0  # for requests without a seed
    model_id: str | None = None  # the name routers and hashes use; None: the model directory's name
    num_threads: int | None = None  # torch intra-op threads; None: torch's default
    tp_size: int = 1  # tensor-parallel ranks (processes; gloo on CPU, NCCL on CUDA)
    fast_linears: bool = True  # CPU fast paths for linear layers (engine/linear_fast.py); False: plain F.linear
    device: str = "cpu"  # "cpu", "cuda" or "auto" (cuda when available): weights, KV cache and step tensors
    cuda_graphs: bool = True  # on CUDA, decode-only steps replay captured graphs (engine/cuda_graphs.py)
    cuda_graph_batch_sizes: tuple[int, ...] | None = None  # graph buckets; None: 1, 2, 4, 8, 16, 24, 32, 48, ...
    # one of QUANTIZATIONS: auto keeps a GGUF's Q4/Q8 linears packed (the default model decodes ~2.5x faster from
    # them on CPU than dense fp32: benchmarks/RESULTS.md, issue 18) and leaves a dense checkpoint dense
    quantization: str = "auto"
    quantized_activations: str = "float"  # one of QUANTIZED_ACTIVATIONS
    # speculative decoding, vLLM's speculative_config (engine/speculative_config.py): a dict or its JSON text, kept
    # as canonical JSON (so the config stays flat and travels in to_json / to_flags); None: off
    speculative_config: str | None = None

    def __post_init__(self) -> None:
        if self.dtype is not None:
            canonical_dtype(self.dtype)
        for name in ("block_size", "kv_cache_bytes", "max_num_seqs", "max_num_batched_tokens", "tp_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} is invalid: must be >= 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks={self.num_kv_blocks} is invalid: must be >= 1")
        fraction = self.kv_cache_memory_fraction
        if fraction is not None:
            if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
                raise ValueError(f"kv_cache_memory_fraction={fraction!r} is invalid: must be in (0, 1]")
            if self.num_kv_blocks is not None:
                raise ValueError(f"num_kv_blocks={self.num_kv_blocks} and kv_cache_memory_fraction={fraction} "
                                 "both size the KV cache: give one")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len={self.max_model_len} is invalid: must be >= 2")
        if self.device not in DEVICES:
            raise ValueError(f"device={self.device!r} is invalid: must be one of {', '.join(DEVICES)}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization={self.quantization!r} is invalid: must be one of "
                             f"{', '.join(QUANTIZATIONS)}")
        if self.quantized_activations not in QUANTIZED_ACTIVATIONS:
            raise ValueError(f"quantized_activations={self.quantized_activations!r} is invalid: must be one of "
                             f"{', '.join(QUANTIZED_ACTIVATIONS)}")
        if self.quantized_activations == "int8" and self.device != "cpu":
            raise ValueError(f"quantized_activations='int8' is invalid with device={self.device!r}: it is a CPU "
                             "kernel path (CUDA runs the Triton kernels on float activations)")
        if self.speculative_config is not None:  # validated here; canonical text so equal configs compare equal
            speculative = SpeculativeConfig.parse(self.speculative_config)
            object.__setattr__(self, "speculative_config", speculative.to_json())
        sizes = self.cuda_graph_batch_sizes
        if sizes is not None:
            sizes = tuple(sizes)
            object.__setattr__(self, "cuda_graph_batch_sizes", sizes)  # frozen: a list given is kept as a tuple
            if not sizes or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in sizes):
                raise ValueError(f"cuda_graph_batch_sizes={sizes!r} is invalid: must be ints >= 1, at least one")

    def to_json(self) -> str:
        """Every field as one JSON object; `from_json` gives back an equal config."""
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> EngineConfig:
        """The config `to_json` wrote. Raises ValueError for malformed JSON, unknown fields, or values
        `EngineConfig` rejects."""
        values = json_object(text, "engine config")
        unknown = sorted(set(values) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"engine config fields {', '.join(unknown)} are unknown")
        return cls(**values)  # __post_init__ validates and turns cuda_graph_batch_sizes back into a tuple

    @classmethod
    def from_flags(cls, args: argparse.Namespace, **fields: object) -> EngineConfig:
        """The config the flags `add_engine_flags` added were parsed into, plus `fields` (settings that
        have no flag on this command, e.g. model_id)."""
        return cls(**{f.field: getattr(args, f.field) for f in ENGINE_FLAGS}, **fields)

    def to_flags(self) -> list[str]:
        """Command-line flags that `from_flags` parses back into this config: one per setting that differs
        from its default. Raises ValueError if a setting that differs has no flag (it would be lost)."""
        flagged = {f.field: f for f in ENGINE_FLAGS}
        argv: list[str] = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value == f.default:
                continue
            if f.name not in flagged:
                raise ValueError(f"{f.name}={value!r} has no command-line flag: pass the config as JSON instead")
            argv += flagged[f.name].spell(value)
        return argv


@dataclass(frozen=True)
class EngineFlag:
    """How one `EngineConfig` field is spelled on the command line. A bool field (True by default) is a
    `--no-...` switch; a tuple field is comma-separated ints; the rest take one value of the field's type."""

    field: str
    flag: str
    help: str | None = None
    choices: tuple[str, ...] | None = None

    @property
    def kind(self) -> str:
        """"switch", "ints", "int", "float" or "str", from the field's annotation."""
        hint = str(typing.get_type_hints(EngineConfig)[self.field])
        for kind, mark in (("switch", "bool"), ("ints", "tuple"), ("int", "int"), ("float", "float"), ("str", "str")):
            if mark in hint:
                return kind
        raise TypeError(f"EngineConfig.{self.field}: {hint} has no command-line spelling")

    def spell(self, value: object) -> list[str]:
        """The argv that sets the field to `value` (nothing for a switch left at its default)."""
        kind = self.kind
        if kind == "switch":
            return [] if value else [self.flag]
        if kind == "ints":
            return [self.flag, ",".join(map(str, value))]
        return [self.flag, str(value)]


ENGINE_FLAGS: tuple[EngineFlag, ...] = (
    EngineFlag("dtype", "--dtype", "float32|float16|bfloat16 (default: the checkpoint's)"),
    EngineFlag("block_size", "--block-size", "KV block size in tokens"),
    EngineFlag("num_kv_blocks", "--num-kv-blocks", "KV cache size in blocks (default: from memory: "
               "--kv-cache-memory-fraction, else a 2 GiB budget, capped by what --max-num-seqs sequences of "
               "--max-model-len can use)"),
    EngineFlag("kv_cache_memory_fraction", "--kv-cache-memory-fraction",
               "fraction (0, 1] of the device's memory (the GPU's; on CPU the container's limit or RAM) this worker "
               "may fill with weights and KV cache; the KV cache gets what the weights leave of it (vLLM's "
               "--gpu-memory-utilization; default: a 2 GiB KV cache)"),
    EngineFlag("max_num_seqs", "--max-num-seqs"),
    EngineFlag("max_num_batched_tokens", "--max-num-batched-tokens", "token budget per step (prefill chunk)"),
    EngineFlag("max_model_len", "--max-model-len"),
    EngineFlag("enable_prefix_caching", "--no-prefix-caching"),
    EngineFlag("num_threads", "--threads", "torch intra-op threads"),
    EngineFlag("tp_size", "--tp", "tensor-parallel ranks (processes; gloo on CPU)"),
    EngineFlag("device", "--device", "where weights, KV cache and steps live; auto: cuda when available "
               "(default: cpu)", choices=DEVICES),
    EngineFlag("cuda_graphs", "--no-cuda-graphs",
               "on CUDA, run decode steps eagerly instead of replaying captured CUDA graphs"),
    EngineFlag("cuda_graph_batch_sizes", "--cuda-graph-batch-sizes",
               "batch sizes captured as CUDA graphs, e.g. 1,2,4,8 (default: 1,2,4,8,16,24,32,48,... up to "
               "--max-num-seqs)"),
    EngineFlag("quantization", "--quantization", "how linear weights are held: auto = a GGUF file's Q4_0/Q4_1/"
               "Q8_0 kept as stored (other types dequantized), a dense checkpoint dense; none = dense in --dtype; "
               "int8 / int4 = round-to-nearest on load (default: auto)", choices=QUANTIZATIONS),
    EngineFlag("speculative_config", "--speculative-config", "speculative decoding as vLLM's speculative_config JSON, "
               "e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}' "
               "(default: off)"),
    EngineFlag("quantized_activations", "--quantized-activations", "what quantized linears multiply on CPU: float = "
               "the activations as they are (default; the dequantized model's results), int8 = rounded per 32 "
               "inputs to int8 for integer dot products, as llama.cpp does (faster, not exact)",
               choices=QUANTIZED_ACTIVATIONS),
)


def parse_batch_sizes(text: str) -> tuple[int, ...]:
    """"1,2,4" -> (1, 2, 4); an argparse type, so a bad value is a usage error naming the flag."""
    try:
        sizes = tuple(int(t) for t in text.replace(" ", "").split(",") if t != "")
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"--cuda-graph-batch-sizes={text!r} is invalid: must be comma-separated "
                                         "ints >= 1")
    return sizes


def add_engine_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """Add a flag for every entry of `ENGINE_FLAGS`, each parsed into its field's name with the field's
    default (`EngineConfig.from_flags` reads them back)."""
    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    for f in ENGINE_FLAGS:
        kind, default = f.kind, defaults[f.field]
        if kind == "switch":
            assert default is True, f"{f.flag} turns {f.field} off, so its default must be True"
            parser.add_argument(f.flag, dest=f.field, action="store_false", help=f.help)
            continue
        parse = {"ints": parse_batch_sizes, "int": int, "float": float, "str": str}[kind]
        parser.add_argument(f.flag, dest=f.field, type=parse, default=default, choices=f.choices, help=f.help)
