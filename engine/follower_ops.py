"""Operations rank 0 asks a tensor-parallel follower rank to run, as typed values on the wire.

An operation is a frozen dataclass whose fields are int, float, str, bool, None-able versions of those,
`tuple[T, ...]` of a supported type, or another such dataclass. It crosses as one JSON object, no pickle:

    {"op": "<class name>", "fields": {<field>: <value>, ...}}      tuples as lists, nested dataclasses as objects

`decode_op` accepts only the classes its caller names, and only with exactly their fields, each of its
declared type; anything else raises `OpDecodeError` naming the op and the field. An encoded op is at most
`MAX_OP_BYTES` long. Which classes exist, and what a follower does with each, is the serving workers'
business (prefill_worker/tp_ops.py, decode_worker/tp_ops.py); the engine only carries them (the CALL in
engine/tp_runner.py) and dispatches each to the one method a follower's `FollowerHooks.handlers` names for
its class. Each rank answers a `CallStatus`; rank 0 gets them all, in rank order, as a `CallResult`.

Why a hand-written codec and not msgspec or pydantic: it is ~80 lines of the standard library over a handful of
flat control messages between ranks of one worker, and it is stricter than their defaults where it matters here
(extra fields, NaN, a bool for an int are refused), without another dependency in the engine.
"""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields, is_dataclass
from enum import IntEnum
from typing import Any, TypeVar

MAX_OP_BYTES = 16 << 20
T = TypeVar("T")


class OpDecodeError(ValueError):
    """The bytes are not an operation this rank knows: not JSON, an unknown op, or a field missing, extra or of
    the wrong type."""


class UnknownOp(OpDecodeError):
    """A well-formed message naming an op this rank does not run."""


class CallStatus(IntEnum):
    """One rank's answer to a CALL."""
    DONE = 0
    REFUSED = 1  # its handler returned False
    FAILED = 2  # its handler raised
    UNKNOWN_OP = 3  # not an op this rank runs, or malformed (`OpDecodeError`)


@dataclass(frozen=True)
class CallResult:
    """What every rank answered to one CALL: `statuses[r]` is rank r's (rank 0's own is DONE)."""
    op_name: str
    statuses: tuple[CallStatus, ...]

    @property
    def ok(self) -> bool:
        return all(s is CallStatus.DONE for s in self.statuses)

    def failures(self) -> str:
        """Each failing rank and how, e.g. `rank 1: unknown_op, rank 3: refused` (empty when ok), for logs."""
        return ", ".join(f"rank {r}: {s.name.lower()}" for r, s in enumerate(self.statuses) if s is not CallStatus.DONE)


OpHandler = Callable[[Any], bool]


class FollowerHooks:
    """What a serving worker adds to a follower rank (see prefill_worker/tp_rank.py, decode_worker/tp_rank.py).

    The base runs no operations and does nothing per step: a plain TP engine's followers."""

    def handlers(self) -> Mapping[type, OpHandler]:
        """The operations this rank runs: each op class to the one method that runs it. A method returns True
        when done; False (REFUSED) or an exception (FAILED) tells rank 0 it failed here, and this rank goes on."""
        return {}

    def layer_callback(self) -> Callable[[int], None] | None:
        """`on_layer_done` for the next STEP's forward (None: nothing to do per layer)."""
        return None

    def after_step(self) -> None:
        """Called after each STEP's forward on this rank."""

    def close(self) -> None:
        """Release what the hooks hold (sockets, threads); the rank is exiting."""


def encode_op(op: Any) -> bytes:
    """The op as UTF-8 JSON. Raises TypeError for anything but a frozen dataclass instance, ValueError past
    `MAX_OP_BYTES` (or for a NaN or infinite float)."""
    if not is_dataclass(op) or isinstance(op, type) or not op.__dataclass_params__.frozen:
        raise TypeError(f"{op!r} is not an operation: must be an instance of a frozen dataclass")
    body = json.dumps({"op": type(op).__name__, "fields": _to_json(op)}, separators=(",", ":"),
                      allow_nan=False).encode()
    if len(body) > MAX_OP_BYTES:
        raise ValueError(f"op {type(op).__name__} encodes to {len(body)} bytes: must be <= {MAX_OP_BYTES}")
    return body


def decode_op(body: bytes, op_types: Iterable[type[T]]) -> T:
    """The op `encode_op` made `body` from, if its class is one of `op_types`; else `OpDecodeError`."""
    known = {t.__name__: t for t in op_types}
    if len(body) > MAX_OP_BYTES:
        raise OpDecodeError(f"an op of {len(body)} bytes: must be <= {MAX_OP_BYTES}")
    try:
        message = json.loads(body, parse_constant=_refuse_constant)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise OpDecodeError(f"an op must be UTF-8 JSON: {e}") from None
    if not isinstance(message, dict) or set(message) != {"op", "fields"}:
        raise OpDecodeError(f"an op must be an object with keys 'op' and 'fields', got {str(message)[:200]}")
    name = message["op"]
    cls = known.get(name) if isinstance(name, str) else None
    if cls is None:
        raise UnknownOp(f"op={name!r} is unknown here: this rank runs {sorted(known)}")
    return _from_json(message["fields"], cls, name)


def _refuse_constant(name: str) -> Any:
    raise OpDecodeError(f"{name} is not a number an op may carry")


def _to_json(value: Any) -> Any:
    if is_dataclass(value):
        return {f.name: _to_json(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, tuple):
        return [_to_json(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"{value!r} of type {type(value).__name__} cannot cross as an op field")


def _from_json(value: Any, hint: Any, where: str) -> Any:
    """`value` (parsed JSON) as the type `hint`, checked; `where` names the field in errors."""
    if isinstance(hint, type) and is_dataclass(hint):
        if not isinstance(value, dict):
            raise OpDecodeError(f"{where}: expected an object for {hint.__name__}, got {type(value).__name__}")
        names = [f.name for f in fields(hint)]
        if set(value) != set(names):
            raise OpDecodeError(f"{where}: fields {sorted(value)} differ from {hint.__name__}'s {sorted(names)}")
        hints = typing.get_type_hints(hint)
        kwargs = {n: _from_json(value[n], hints[n], f"{where}.{n}") for n in names}
        try:
            return hint(**kwargs)
        except (TypeError, ValueError) as e:  # the class's own checks (__post_init__)
            raise OpDecodeError(f"{where}: {e}") from None
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is tuple:
        if len(args) != 2 or args[1] is not Ellipsis:
            raise TypeError(f"{where}: {hint} is not supported on the wire: use tuple[T, ...]")
        if not isinstance(value, list):
            raise OpDecodeError(f"{where}: expected a list, got {type(value).__name__}")
        return tuple(_from_json(v, args[0], f"{where}[{i}]") for i, v in enumerate(value))
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and value is None:
            return None
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1:
            raise TypeError(f"{where}: {hint} is not supported on the wire: only `T | None`")
        return _from_json(value, rest[0], where)
    if hint is bool:
        ok = isinstance(value, bool)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif hint is str:
        ok = isinstance(value, str)
    else:
        raise TypeError(f"{where}: {hint} is not supported on the wire")
    if not ok:
        raise OpDecodeError(f"{where}: expected {hint.__name__}, got {type(value).__name__} {str(value)[:100]}")
    return value
