"""`duet chat`: an interactive terminal chat, offline on the engine or against a running router.

    duet chat [--model M] [--system TEXT]          # the engine in this process
    duet chat --addr HOST:PORT [--auth-token T]    # a router's public gRPC API

Each line read is a user message; the answer streams to stdout and ends with a newline. The history
(system, user and assistant messages) goes with every turn; the model's chat template is applied by the
engine or the router. `/reset` clears the history (the system message stays), `/exit` (or `/bye`) or end of input
(Ctrl-D) leaves with status 0, Ctrl-C during an answer stops that answer. A turn that did not finish
(stopped, or refused) leaves the history as it was before the user's line. The `>>> ` prompt is shown
only when stdin is a terminal, so piped output is exactly the answers, one after another.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TextIO

from duet.cli_common import add_engine_args, add_sampling_args, engine_config, sampling_params
from engine.errors import InvalidRequestError

if TYPE_CHECKING:
    from duet.client import Client
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

PROMPT_MARKER = ">>> "
DEFAULT_MAX_TOKENS = 512
CONNECT_TIMEOUT_S = 10.0
COMMANDS_HELP = "/reset clears the history, /exit (or Ctrl-D) leaves, Ctrl-C stops an answer"

Message = dict[str, str]  # {"role": ..., "content": ...}: what LLM.chat and the gRPC chat prompt take


class ChatUnavailableError(Exception):
    """The backend cannot serve any further turn (the router went away): the session ends with status 1."""


class TurnRefusedError(Exception):
    """The engine or router refused one turn (too long for the context, no capacity): reported, the turn is
    dropped and the session goes on."""


class Interrupt:
    """While entered, SIGINT (Ctrl-C) sets `pressed` and calls `on_press` instead of raising
    KeyboardInterrupt: the engine is stepped in this thread, and an exception in the middle of a step
    would leave its scheduler half updated. The previous handler is restored on exit."""

    def __init__(self) -> None:
        self.pressed = threading.Event()
        self.on_press: Callable[[], None] | None = None
        self._previous = None

    def __enter__(self) -> Interrupt:
        self.pressed.clear()
        self.on_press = None
        self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGINT, self._previous)

    def _handle(self, signum, frame) -> None:
        self.pressed.set()
        if self.on_press is not None:
            self.on_press()


class ChatBackend(Protocol):
    def answer(self, messages: list[Message], interrupt: Interrupt) -> Iterator[str]:
        """Yield the reply's text deltas as they are generated (possibly empty ones), so that the caller sees
        `interrupt.pressed` between them; closing the iterator early cancels the request. A backend that
        can block between deltas sets `interrupt.on_press` to wake itself (it then ends quietly). Raises
        `TurnRefusedError` for a turn the engine or router refuses (the session goes on) and
        `ChatUnavailableError` when no further turn can be served."""
        ...

    def close(self) -> None: ...


class OfflineChat:
    """Answers with an `engine.LLM` in this process (its tokenizer's chat template)."""

    def __init__(self, llm: LLM, params: SamplingParams) -> None:
        self.llm = llm
        self.params = params

    def answer(self, messages: list[Message], interrupt: Interrupt) -> Iterator[str]:
        prompt_ids = self.llm.tokenizer.apply_chat_template_ids(messages, add_generation_prompt=True)
        stream = self.llm.generate_stream(prompt_ids, self.params)
        try:
            for out in stream:  # one delta per engine step: Ctrl-C is seen between steps
                for sample in out.outputs:
                    yield sample.text
        except InvalidRequestError as e:
            raise TurnRefusedError(str(e)) from None
        finally:
            stream.close()  # aborts the request if it is still running

    def close(self) -> None:
        self.llm.close()


class RemoteChat:
    """Answers through a router's Generate call, the history sent as its chat prompt."""

    def __init__(self, client: Client, address: str, params: SamplingParams) -> None:
        self.client = client
        self.address = address
        self.params = params

    def check_reachable(self, timeout_s: float) -> None:
        """Raise `ChatUnavailableError` unless the router answers its health check as serving."""
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        try:
            reply = health_pb2_grpc.HealthStub(self.client.channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError as e:
            raise ChatUnavailableError(f"cannot reach the router at {self.address}: {_rpc_reason(e)}") from None
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            raise ChatUnavailableError(f"the router at {self.address} is not serving")

    def answer(self, messages: list[Message], interrupt: Interrupt) -> Iterator[str]:
        import grpc

        stream = self.client.generate(messages, self.params)
        interrupt.on_press = stream.cancel  # wakes the blocked read below; the router aborts on every worker
        try:
            for msg in stream:
                yield msg.text
        except grpc.RpcError as e:
            if interrupt.pressed.is_set() and e.code() == grpc.StatusCode.CANCELLED:
                return
            if e.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                            grpc.StatusCode.DEADLINE_EXCEEDED):
                raise TurnRefusedError(f"the router refused this turn: {_rpc_reason(e)}") from None
            raise ChatUnavailableError(f"the router at {self.address} failed: {_rpc_reason(e)}") from None
        finally:
            interrupt.on_press = None
            stream.cancel()  # no-op once the stream has ended

    def close(self) -> None:
        self.client.close()


def _rpc_reason(e) -> str:
    return f"{e.code().name}: {e.details()}"


class ChatSession:
    """The conversation: an optional system message, then alternating user and assistant messages."""

    def __init__(self, system: str | None) -> None:
        self.system = system
        self.messages: list[Message] = []
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def with_user(self, text: str) -> list[Message]:
        """The history plus a user message (the history itself unchanged until `commit`)."""
        return [*self.messages, {"role": "user", "content": text}]

    def commit(self, user_text: str, answer_text: str) -> None:
        self.messages += [{"role": "user", "content": user_text}, {"role": "assistant", "content": answer_text}]


def run_chat(backend: ChatBackend, session: ChatSession, stdin: TextIO, stdout: TextIO, stderr: TextIO) -> int:
    """Read lines until /exit or end of input; 0 then, 1 if the backend became unavailable."""
    interactive = stdin.isatty()
    if interactive:
        print(f"duet chat: {COMMANDS_HELP}", file=stderr)
    interrupt = Interrupt()
    while True:
        try:
            line = _read_line(stdin, stdout, interactive)
        except KeyboardInterrupt:
            print(f"\n({COMMANDS_HELP})", file=stderr)
            continue
        if line is None or line.strip() in ("/exit", "/bye"):
            return 0
        text = line.strip()
        if not text:
            continue
        if text == "/reset":
            session.reset()
            print("(history cleared)", file=stderr)
            continue
        if text.startswith("/"):
            print(f"unknown command {text.split()[0]!r}: {COMMANDS_HELP}", file=stderr)
            continue
        try:
            answer = _stream_answer(backend, session.with_user(text), interrupt, stdout)
        except TurnRefusedError as e:
            print(f"error: {e} (the turn was dropped; /reset starts a new conversation)", file=stderr)
            continue
        except ChatUnavailableError as e:
            print(f"error: {e}", file=stderr)
            return 1
        if answer is None:
            print("(stopped)", file=stderr)
        else:
            session.commit(text, answer)


def _read_line(stdin: TextIO, stdout: TextIO, interactive: bool) -> str | None:
    """The next line without its newline; None at end of input."""
    if interactive and stdin is sys.stdin:
        try:
            return input(PROMPT_MARKER)  # input() on a terminal gives line editing (readline, imported below)
        except EOFError:
            stdout.write("\n")
            return None
    if interactive:
        stdout.write(PROMPT_MARKER)
        stdout.flush()
    line = stdin.readline()
    return None if line == "" else line.rstrip("\n")


def _stream_answer(backend: ChatBackend, messages: list[Message], interrupt: Interrupt, stdout: TextIO) -> str | None:
    """Stream one answer to stdout, ending it with a newline; its text, or None if Ctrl-C stopped it."""
    parts: list[str] = []
    completed = False
    with interrupt:
        deltas = backend.answer(messages, interrupt)
        try:
            for delta in deltas:
                if delta:
                    parts.append(delta)
                    stdout.write(delta)
                    stdout.flush()
                if interrupt.pressed.is_set():
                    break
            else:
                completed = True
        finally:
            deltas.close()
            if completed or parts or interrupt.pressed.is_set():
                stdout.write("\n")
                stdout.flush()
    return None if interrupt.pressed.is_set() else "".join(parts)


def cmd_chat(args: argparse.Namespace) -> int:
    """Exit status: 0 when the user leaves, 1 when the router cannot be reached or goes away, 2 for bad
    flags, 130 for Ctrl-C while the model loads or the router is being reached."""
    _check_flags(args)
    params = sampling_params(args)
    if sys.stdin.isatty():
        import readline  # noqa: F401  (line editing and history for input())
    try:
        backend = _remote_backend(args, params) if args.addr is not None else _offline_backend(args, params)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    try:
        if isinstance(backend, RemoteChat):
            backend.check_reachable(CONNECT_TIMEOUT_S)
        return run_chat(backend, ChatSession(args.system), sys.stdin, sys.stdout, sys.stderr)
    except ChatUnavailableError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    finally:
        backend.close()


def _check_flags(args: argparse.Namespace) -> None:
    """Refuse (exit 2, naming the flag) a flag that the chosen side would not use."""
    if args.addr is not None:
        engine_flags = [f for f in engine_config(args).to_flags() if f.startswith("--")]
        given = (["--model"] if args.model is not None else []) + engine_flags
        if given:
            args.parser.error(f"{', '.join(given)} only apply offline: with --addr the router's model and "
                              "engine answer")
        if args.tls_ca is not None and not args.tls_ca.is_file():
            args.parser.error(f"--tls-ca {args.tls_ca}: no such file (a PEM root certificate)")
    elif args.auth_token is not None or args.tls_ca is not None:
        args.parser.error("--auth-token and --tls-ca only apply with --addr")


def _offline_backend(args: argparse.Namespace, params: SamplingParams) -> OfflineChat:
    import dataclasses

    from engine.default_model import DEFAULT_MODEL_LABEL
    from engine.llm import LLM

    if sys.stdin.isatty():
        print(f"loading {args.model or DEFAULT_MODEL_LABEL} ...", file=sys.stderr, flush=True)
    return OfflineChat(LLM(args.model, **dataclasses.asdict(engine_config(args))), params)


def _remote_backend(args: argparse.Namespace, params: SamplingParams) -> RemoteChat:
    from duet.client import Client

    root_cert = args.tls_ca.read_bytes() if args.tls_ca else None
    return RemoteChat(Client(args.addr, auth_token=args.auth_token, root_cert=root_cert), args.addr, params)


def add_chat_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="interactive chat in the terminal, offline or against a router (--addr)")
    add_engine_args(p)
    add_sampling_args(p, max_tokens=DEFAULT_MAX_TOKENS, logprobs=False)
    p.add_argument("--system", default=None, help="system message that starts every conversation")
    g = p.add_argument_group("remote")
    g.add_argument("--addr", default=None, help="router host:port (default: the engine in this process)")
    g.add_argument("--auth-token", default=None)
    g.add_argument("--tls-ca", type=Path, default=None, help="PEM root certificate: connect with TLS")
    p.set_defaults(func=cmd_chat, parser=p)
