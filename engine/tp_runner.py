"""Running a tensor-parallel model: rank 0 drives, the other ranks follow, step by step.

    rank 0 (the engine's process: ModelRunner     ranks 1..N-1 (worker processes, `run_tp_worker`)
            with a TPDriver as step_broadcaster)  │
    scheduler ─▶ prepare_inputs                   │
    broadcast header [cmd, sizes]  ──────────────▶│ receive header
    broadcast one int64 payload    ──────────────▶│ receive payload, rebuild the same inputs
    forward (all-reduces inside) ◀──────────────▶ │ forward
    compute_logits (all-gather)  ◀──────────────▶ │ compute_logits
    sample (rank 0 only)                          │ loop; cmd STOP ends it

Every rank holds its own KV cache shard (its kv heads) and writes it in its own forward, so only token
ids, positions and block tables cross between ranks: no tensors of activations except inside the
collectives. The payload is plain int64 (no pickle). A rank that dies makes the next collective fail on
the others (gloo reports the closed connection), so the engine raises instead of hanging.

Serving workers give each follower `FollowerHooks` (its share of KV transfer) and drive them with CALL,
one typed operation at a time (engine/follower_ops.py):

    rank 0: call_followers(op)  ── header [CALL, n] + n bytes: encode_op(op) ──▶ decode_op, then the one
                                                                                hooks.handlers()[type(op)]
            all ranks: all-gather of each rank's CallStatus  ◀───────────────▶  (rank 0 learns who did it)

A follower that cannot decode the op, does not run it, refuses it or raises in it answers so and goes on.

A STEP's forward on a follower gets `hooks.layer_callback()` as its `on_layer_done`, so a follower ships
its KV shard while later layers compute, exactly as rank 0 does.
"""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import sys
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from engine.attention import AttentionMetadata, PrefillChunk
from engine.config import EngineConfig, ModelConfig
from engine.follower_ops import MAX_OP_BYTES, CallResult, CallStatus, FollowerHooks, OpDecodeError, decode_op, encode_op
from engine.kernels.decode_attention import context_lens_from_mask, mask_from_context_lens, twin_runs
from engine.model import KVCache, LlamaForCausalLM
from engine.ports import pick_free_port

log = logging.getLogger("duet.tp")

STEP, STOP, CALL = 1, 2, 3
_HEADER = 7  # cmd, tokens, decodes, decode width (blocks), prefills, prefill table ids, sample rows


def pack_step(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, block_size: int,
              sample_rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(header, payload): everything a follower rank needs to run the same forward pass."""
    num_decodes = meta.num_decode_tokens
    width = 0
    parts = [input_ids, positions, meta.slot_mapping]
    if num_decodes:
        width = meta.decode_block_ids.numel() // num_decodes
        context_lens = meta.decode_context_lens  # a step carries lengths, and a mask where the twin runs
        if context_lens is None:
            context_lens = context_lens_from_mask(meta.decode_mask)
        parts += [meta.decode_block_ids, context_lens]
    tables = [p.block_table for p in meta.prefills]
    desc = [[p.query_start, p.num_query_tokens, p.num_context_tokens, p.block_table.numel()] for p in meta.prefills]
    parts += [torch.tensor(desc, dtype=torch.int64).view(-1), *tables, torch.tensor(sample_rows, dtype=torch.int64)]
    payload = torch.cat([t.to("cpu", torch.int64).view(-1) for t in parts])  # the control group is gloo: host memory
    header = torch.tensor([STEP, input_ids.numel(), num_decodes, width, len(tables), sum(t.numel() for t in tables),
                           len(sample_rows)], dtype=torch.int64)
    return header, payload


def unpack_step(header: torch.Tensor, payload: torch.Tensor, block_size: int, device: torch.device | None = None,
                dtype: torch.dtype = torch.float32):
    """The inverse of `pack_step`: (input_ids, positions, meta, sample_rows), tensors on `device` (CPU default), the
    decodes' mask too where attention over caches of `dtype` runs the twin there."""
    _, num_tokens, num_decodes, width, num_prefills, _, num_samples = header.tolist()
    cursor = 0

    def take(n: int) -> torch.Tensor:
        nonlocal cursor
        out = payload[cursor : cursor + n]
        cursor += n
        return out

    on_device = device is not None and device.type != "cpu"

    def put(t: torch.Tensor) -> torch.Tensor:
        return t.to(device) if on_device else t.clone()

    input_ids, positions, slots = take(num_tokens), take(num_tokens), take(num_tokens)
    decode_block_ids = decode_mask = decode_context_lens = None
    if num_decodes:
        decode_block_ids = put(take(num_decodes * width))
        decode_context_lens = take(num_decodes).to(device or "cpu", torch.int32)
        if twin_runs(dtype, decode_context_lens.device):  # the mask too, built once here, not once a layer
            decode_mask = mask_from_context_lens(decode_context_lens, width * block_size)
    desc = take(4 * num_prefills).view(num_prefills, 4).tolist()
    prefills = [PrefillChunk(q0, nq, nctx, put(take(n))) for q0, nq, nctx, n in desc]
    sample_rows = take(num_samples).tolist()
    meta = AttentionMetadata(slot_mapping=put(slots), num_decode_tokens=num_decodes,
                             decode_block_ids=decode_block_ids, decode_mask=decode_mask, prefills=prefills,
                             decode_context_lens=decode_context_lens)
    return put(input_ids), put(positions), meta, sample_rows


class TPDriver:
    """Rank 0's side of the control group: the `StepBroadcaster` that rank 0's `ModelRunner` composes (it
    broadcasts each eager step, then runs its own forward and samples), the CALLs of serving workers, STOP."""

    def __init__(self, block_size: int, group=None):
        self.block_size = block_size
        self.group = group

    def broadcast_step(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                       sample_rows: list[int]) -> None:
        """Send one step (header, then payload) to every follower; see `pack_step`."""
        header, payload = pack_step(input_ids, positions, meta, self.block_size, sample_rows)
        dist.broadcast(header, src=0, group=self.group)
        dist.broadcast(payload, src=0, group=self.group)

    def call_followers(self, op: object) -> CallResult:
        """`call_followers(op, self.group)`."""
        return call_followers(op, self.group)

    def shutdown(self) -> None:
        """Tell the followers to exit (best effort: they also exit when this process dies)."""
        try:
            dist.broadcast(torch.tensor([STOP] + [0] * (_HEADER - 1), dtype=torch.int64), src=0, group=self.group)
        except (RuntimeError, ValueError):
            pass


def call_followers(op: object, group) -> CallResult:
    """Rank 0: run `op` (a frozen dataclass, engine/follower_ops.py) on every follower of `group`: each decodes
    it and runs the method its hooks name for the op's class. Returns every rank's status (failures are also
    logged); raises ValueError if the op does not encode (engine/follower_ops.encode_op), RuntimeError if a
    rank is gone."""
    body = encode_op(op)
    dist.broadcast(torch.tensor([CALL, len(body)] + [0] * (_HEADER - 2), dtype=torch.int64), src=0, group=group)
    dist.broadcast(torch.frombuffer(bytearray(body), dtype=torch.uint8), src=0, group=group)
    result = CallResult(type(op).__name__, _gather_status(CallStatus.DONE, group))
    if not result.ok:
        log.warning("tp event=call_failed op=%s %s", result.op_name, result.failures())
    return result


def _gather_status(status: CallStatus, group) -> tuple[CallStatus, ...]:
    """Every rank's status of this CALL, in rank order (a collective: every rank calls it once per CALL)."""
    mine = torch.tensor([int(status)], dtype=torch.int64)
    everyone = [torch.empty(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    return tuple(CallStatus(int(t)) for t in everyone)


def _run_call(hooks: FollowerHooks, header: torch.Tensor, group) -> None:
    size = int(header[1])
    if not 0 < size <= MAX_OP_BYTES:
        raise RuntimeError(f"CALL of {size} bytes from rank 0: must be in (0, {MAX_OP_BYTES}]")
    body = torch.empty(size, dtype=torch.uint8)
    dist.broadcast(body, src=0, group=group)
    handlers = hooks.handlers()
    try:
        op = decode_op(bytes(body.numpy()), handlers)
        status = CallStatus.DONE if handlers[type(op)](op) else CallStatus.REFUSED
    except OpDecodeError as e:
        log.warning("tp follower event=call_unknown error=%s", e)
        status = CallStatus.UNKNOWN_OP
    except Exception as e:  # noqa: BLE001 - reported to rank 0 through the all-gather, this rank goes on
        log.warning("tp follower event=call_failed error=%r", e)
        status = CallStatus.FAILED
    _gather_status(status, group)


@torch.inference_mode()
def follow(model: LlamaForCausalLM, kv_caches: list[KVCache], block_size: int, group=None,
           hooks: FollowerHooks | None = None) -> None:
    """A follower rank's loop: run every step and call rank 0 broadcasts, until STOP."""
    hooks = hooks or FollowerHooks()
    device = model.embed_tokens.weight.device
    while True:
        header = torch.empty(_HEADER, dtype=torch.int64)
        dist.broadcast(header, src=0, group=group)
        if int(header[0]) == STOP:
            return
        if int(header[0]) == CALL:
            _run_call(hooks, header, group)
            continue
        size = 3 * int(header[1]) + int(header[2]) * (int(header[3]) + 1) + 4 * int(header[4]) + int(header[5]) \
            + int(header[6])
        payload = torch.empty(size, dtype=torch.int64)
        dist.broadcast(payload, src=0, group=group)
        input_ids, positions, meta, sample_rows = unpack_step(header, payload, block_size, device,
                                                              kv_caches[0][0].dtype)
        hidden = model(input_ids, positions, kv_caches, meta, hooks.layer_callback())
        if sample_rows:
            model.compute_logits(hidden[sample_rows])  # joins the all-gather; rank 0 samples
        hooks.after_step()


def init_group(rank: int, size: int, init_method: str, timeout_s: float = 120.0, device: torch.device | None = None):
    """Join the ranks; returns the control group the step loop broadcasts on.

    The default group (gloo on CPU, NCCL when the model runs on CUDA: rank r on cuda:r) carries the model's
    collectives and bounds the rendezvous and every step's collectives by `timeout_s`. The control group is gloo (its
    tensors are on the CPU) with a timeout of a day: a follower waits on it for rank 0's next command for as
    long as the worker is idle. A dead rank still fails it at once (gloo sees the connection close)."""
    backend = "gloo"
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)
        backend = "nccl"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout_s))
    return dist.new_group(list(range(size)), timeout=timedelta(days=1), backend="gloo")


def spawn_followers(size: int, init_method: str, model_dir: str | Path, settings: EngineConfig,
                    extra_argv: Sequence[str] = (), module: str = "engine.tp_worker") -> list[subprocess.Popen]:
    """Start ranks 1..size-1 as `python -m <module>` processes (they die with this process). Each gets its
    rank, the group's rendezvous, the checkpoint and the resolved engine settings as one JSON argument
    (engine/tp_worker.py's `engine_arg_parser` reads them), then `extra_argv` (what `module` adds)."""
    from engine.child_process import die_with_parent

    procs = []
    for rank in range(1, size):
        cmd = [sys.executable, "-m", module, "--rank", str(rank), "--size", str(size), "--init-method", init_method,
               "--model", str(model_dir), "--engine-config", settings.to_json(), *extra_argv]
        procs.append(subprocess.Popen(die_with_parent(cmd), stdin=subprocess.DEVNULL))
    return procs


def follower_settings(config: EngineConfig, dtype: torch.dtype, num_blocks: int, max_positions: int,
                      device: torch.device) -> EngineConfig:
    """The settings rank 0 resolved, as every follower must use them: the dtype, the KV cache size in blocks
    (so every rank's shard has the same blocks), the positions the model covers (as `max_model_len`) and
    the device kind ("cuda": rank r runs on cuda:r)."""
    return dataclasses.replace(config, dtype=str(dtype).removeprefix("torch."), num_kv_blocks=num_blocks,
                               kv_cache_memory_fraction=None,  # rank 0 sized the cache in blocks already
                               max_model_len=max_positions, device=device.type)


def start_group(model_config: ModelConfig, model_dir: str | Path, dtype: torch.dtype, max_positions: int,
                num_blocks: int, config: EngineConfig, follower_module: str = "engine.tp_worker",
                follower_argv: Sequence[str] = (), device: torch.device | None = None):
    """Rank 0's side of starting a tensor-parallel engine: spawn the followers with the settings resolved
    here, join the process group, load rank 0's shard, wait until every rank has loaded (and built its
    hooks). On CUDA rank r runs on cuda:r of the GPUs this process sees. Returns (model, follower
    processes, control group)."""
    from engine.linear_fast import linear_fast_paths
    from engine.tensor_parallel import TPGroup
    from engine.weights import build_model

    init_method = f"tcp://127.0.0.1:{pick_free_port()}"
    cuda = device is not None and device.type == "cuda"
    if cuda and torch.cuda.device_count() < config.tp_size:
        raise ValueError(f"tp_size={config.tp_size} is invalid here: needs one GPU per rank, torch sees "
                         f"{torch.cuda.device_count()}")
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    settings = follower_settings(config, dtype, num_blocks, max_positions, device)
    followers = spawn_followers(config.tp_size, init_method, model_dir, settings, follower_argv, follower_module)
    try:
        control = init_group(0, config.tp_size, init_method, device=device)
        model = build_model(model_config, model_dir, dtype, max_positions, device, TPGroup(0, config.tp_size),
                            config.quantization)
        # every shard's GEMMs and the lm_head shard (CPU only; no-op on CUDA)
        linear_fast_paths(model, config.fast_linears, config.quantized_activations)
        dist.barrier()
    except BaseException:
        for proc in followers:
            proc.kill()
        raise
    return model, followers, control


def close_group(driver: TPDriver, followers: list[subprocess.Popen], timeout_s: float = 10.0) -> None:
    """Stop the followers (STOP, then wait, then kill) and leave the process group."""
    driver.shutdown()
    for proc in followers:
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    try:
        dist.destroy_process_group()
    except (RuntimeError, ValueError, AssertionError):
        pass
