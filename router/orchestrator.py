"""One request's hand-off across the cluster, as four named stages:

    lookup   one index round trip: the leading prompt blocks each prefill and each decode worker holds
    admit    predict the request's TTFT (router/admission.py); with --slo-ttft-ms, refuse one that would miss
             the SLO because of the queue: RESOURCE_EXHAUSTED with a retry hint, before anything is reserved
    reserve  rank decode workers by cached overlap and load (router/decode_policy.py); D.Reserve(request)
             holds the prompt's leading blocks D has cached (multi-turn: an earlier turn's prompt and answer)
             and reserves blocks for the rest, and keeps the request (prompt, sampling, salt): the ticket is
             the reservation id, `num_cached_blocks` what D holds already
    plan     the prefill workers whose KV layout D takes; pick prefill worker P (same lookup; the
             speculative index entry is queued off the request's path) -> a `HandOffPlan`
    prefill  P.Prefill(request, target = D's reservation): P computes the prompt, streams the KV of the blocks
             D lacks into D's reserved blocks and samples the first token, which goes to the client at once
    decode   D.Decode(ticket, first token): the reserved request joins D's batch; its tokens stream to the
             client (detokenized and stop strings cut here, router/request_stream.py)
    local    conditional disaggregation: when D's reservation leaves fewer than `local_prefill_tokens` of the
             prompt uncached (Reserve's real count, router/decode_policy.prefills_locally), plan and prefill are
             skipped: D.Decode(ticket, prefill_locally) computes the suffix in D's own batch and streams from
             token 0 on; no prefill worker, no KV transfer (Usage.kv_transferred_tokens 0)
    migrate  D is lost mid-stream: reserve on another decode worker for the prompt plus every token sent but
             the last, have a prefill worker compute that KV (sampling state continued: the seeded step and
             penalties see the tokens), and Decode there with the last token sent: the client's stream goes on
             with exactly the tokens an undisturbed run gives (greedy and seeded), at most MAX_MIGRATIONS times;
             the same when D restarted and no longer knows the reservation, or its KV arrived unusable

Before the first token nothing reached the client, so a hand-off that breaks there (P lost, D lost while
P sends it the KV, D lost while it prefills locally) simply starts again elsewhere. A locally prefilled
request lost after its first token migrates like any other (a migration never prefills locally). Each of
these is a `WorkerLost` whose reason labels duet_router_migrations_total.

A request keeps one id, `request_id` (the client's, or one the router makes), on the router, on both
workers and in every log line. Every downstream call gets the client's remaining deadline; a client
cancel or `Abort` cancels the call in flight and the workers free the request's blocks. A reservation that
will not be decoded is released at once, even one whose Reserve reply was lost to the client's deadline
(released by request id). A worker that fails to answer is avoided for a few seconds
(router/worker_view.py), unless the failure was the request's own: its client's deadline or cancel, or a
worker error marked as the request's fault (grpc_plumbing.REQUEST_FAULT). A KV transfer that failed on the
decode side (grpc_plumbing.KV_TARGET_FAULT) is blamed on the decode worker, not the prefill worker.
Metrics are reported once per stage, through
`RouterMetrics`'s request methods.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import grpc

from cluster.grpc_plumbing import is_kv_target_fault, is_request_fault
from cluster.registry import LiveWorker, WorkerInfo
from duet.internal.v1 import workers_pb2 as wpb
from duet.internal.v1 import workers_pb2_grpc as wpb_grpc
from duet.v1 import generation_pb2 as pb
from engine.detokenizer import IncrementalDetokenizer
from engine.tokenizer import Tokenizer
from router.admission import Admission, LocalPrefill
from router.admission_policy import AdmissionConfig, TTFTPrediction
from router.decode_policy import DecodeState, prefills_locally
from router.decode_policy import rank_decode as rank_decode_by_cache
from router.load_policy import without
from router.metrics import RouterMetrics
from router.prefill_chooser import PrefillChoice, PrefillChooser, PrefixLookup
from router.request_builder import BuiltRequest
from router.request_stream import ClientStream, Failed, Live, downstream_code
from router.worker_view import NoWorkers, WorkerView

log = logging.getLogger("duet.router")
RESERVE_TIMEOUT_S = 5.0
RELEASE_TIMEOUT_S = 2.0
DEFAULT_PUSHBACK_MS = 200  # retry hint when a full decode worker gave none
MAX_MIGRATIONS = 3  # per request; past it, UNAVAILABLE saying what failed
WORKER_POLL_S = 0.2  # while a request waits for a worker to serve again


class WorkerLost(Exception):
    """A worker, or the KV path between two, failed through no fault of the request: the request goes on
    elsewhere. `reason` (a label of duet_router_migrations_total) says which part failed."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


DECODE_LOST, PREFILL_LOST, KV_TRANSFER = "decode_lost", "prefill_lost", "kv_transfer"
# A decode worker's statuses that end its part of a request but not the request: it died or restarted
# (UNAVAILABLE; FAILED_PRECONDITION: the reservation is unknown there now), the KV it was sent is unusable
# (DATA_LOSS, ABORTED), or it failed on its own (INTERNAL/UNKNOWN not marked as the request's fault).
_DECODE_LOST_CODES = {
    grpc.StatusCode.UNAVAILABLE: DECODE_LOST, grpc.StatusCode.FAILED_PRECONDITION: DECODE_LOST,
    grpc.StatusCode.INTERNAL: DECODE_LOST, grpc.StatusCode.UNKNOWN: DECODE_LOST,
    grpc.StatusCode.DATA_LOSS: KV_TRANSFER, grpc.StatusCode.ABORTED: KV_TRANSFER,
}


@dataclass(frozen=True)
class RoutedRequest:
    """A validated request as the orchestrator takes it."""

    request_id: str
    built: BuiltRequest
    cache_salt: str
    received_s: float  # monotonic

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.built.prompt_token_ids


@dataclass(frozen=True)
class Reservation:
    """Blocks a decode worker holds for a request's prompt KV; `ticket` names it to both workers."""

    decode: WorkerInfo
    ticket: int  # the decode worker's reservation id
    kv_addresses: tuple[str, ...]  # its kvtransfer receivers, one per TP rank, in rank order
    num_cached_blocks: int = 0  # the request's leading blocks the decode worker holds from its prefix cache

    @property
    def num_cached_tokens(self) -> int:
        return self.num_cached_blocks * self.decode.block_size

    def kv_target(self) -> wpb.KVTarget:
        return wpb.KVTarget(kv_address=self.kv_addresses[0], reservation_id=self.ticket,
                            kv_addresses=self.kv_addresses, num_cached_blocks=self.num_cached_blocks)


@dataclass(frozen=True)
class HandOffPlan:
    """Where a request goes: the reservation on decode worker `reservation.decode`, prefill on `prefill`."""

    request_id: str
    reservation: Reservation
    prefill: WorkerInfo | None  # None: prefilled on the decode worker itself (conditional disaggregation)
    predicted_cached_tokens: int  # what the index said `prefill` holds of the prompt (local: what D holds)
    routed_tokens: int  # prefill work: sent to `prefill`, the prompt less its predicted cached part; local, what the
    # decode worker lacks
    reserve_s: float
    prediction: TTFTPrediction | None = None  # admission's, for the request's first hand-off (None: a retry)

    @property
    def decode(self) -> WorkerInfo:
        return self.reservation.decode


@dataclass(frozen=True)
class FirstToken:
    """The prefill worker's answer: output token 0 and what the prefill cost."""

    token_id: int
    logprob: pb.TokenLogprob | None
    finish_reason: str  # "" unless the first token already ends the request
    stop_token_id: int | None
    cached_tokens: int
    queue_s: float
    prefill_s: float
    transfer_s: float
    kv_transferred_tokens: int  # tokens whose KV the prefill worker sent to the decode worker

    @classmethod
    def from_reply(cls, reply: wpb.PrefillResponse) -> FirstToken:
        return cls(reply.first_token_id, reply.logprob if reply.HasField("logprob") else None,
                   reply.finish_reason, reply.stop_token_id if reply.HasField("stop_token_id") else None,
                   reply.cached_tokens, reply.queue_s, reply.prefill_s, reply.transfer_s, reply.kv_transferred_tokens)


@dataclass(frozen=True)
class RoutePreview:
    """Where a request would go now, without sending anything (ExplainRoute)."""

    choice: PrefillChoice
    decode_worker_id: str
    prefills: list[LiveWorker]


class _HeldReservation:
    """Counts the request on its decode worker from the reservation on (the worker's load report counts it from
    then: WorkerView.track_requests) until `end`; releases the reservation once, unless the decode worker took the
    request over (then it ends there)."""

    def __init__(self, orchestrator: RequestOrchestrator, reservation: Reservation):
        self._orchestrator, self.reservation, self._done, self._counted = orchestrator, reservation, False, True
        orchestrator.view.track_requests(reservation.decode.worker_id, +1)

    def taken_over(self) -> None:
        self._done = True

    def end(self) -> None:
        """The request is no longer on the decode worker (idempotent)."""
        if self._counted:
            self._counted = False
            self._orchestrator.view.track_requests(self.reservation.decode.worker_id, -1)

    def release(self) -> None:
        if not self._done:
            self._done = True
            self._orchestrator.release(self.reservation)
        self.end()


class RequestOrchestrator:
    def __init__(self, view: WorkerView, chooser: PrefillChooser, metrics: RouterMetrics, tokenizer: Tokenizer,
                 model_id: str, reservation_ttl_s: float, worker_wait_s: float, local_prefill_tokens: int = 0,
                 admission: AdmissionConfig | None = None):
        self.view, self.chooser, self.metrics, self.tokenizer = view, chooser, metrics, tokenizer
        self.admission = Admission(admission or AdmissionConfig(), metrics)
        self.model_id = model_id
        self.reservation_ttl_s = reservation_ttl_s
        self.worker_wait_s = worker_wait_s  # the longest a request waits for a worker to serve again
        # an uncached suffix shorter than this is prefilled on the decode worker (0: never)
        self.local_prefill_tokens = local_prefill_tokens

    def run(self, request: RoutedRequest, live: Live) -> Iterator[pb.GenerateResponse]:
        """The client's messages, first token to last. Raises `Failed` with the status to end the call;
        a cancelled client ends the stream quietly. Reports the request's final status to the metrics."""
        status = "OK"
        try:
            for message in self._run(request, live):
                self.metrics.tokens_sent(len(message.token_ids))
                yield message
        except Failed as f:
            status = f.code.name
            log.info("request=%s event=failed status=%s message=%s", request.request_id, f.code.name, f.message)
            raise
        finally:
            self.metrics.request_ended("CANCELLED" if live.cancelled else status)

    def _run(self, request: RoutedRequest, live: Live) -> Iterator[pb.GenerateResponse]:
        helds: list[_HeldReservation] = []  # one per reservation this request makes (retries add theirs)
        try:
            plan, first = self.hand_off(request, live, helds)
            detok = IncrementalDetokenizer.for_request(self.tokenizer, request.prompt_token_ids,
                                                       request.built.params)
            client = ClientStream(request.request_id, detok, len(request.prompt_token_ids), request.received_s)
            client.timing.reserve_s = plan.reserve_s
            yield from self.decode_migrating(request, plan, first, live, client, helds)
        finally:
            for h in helds:
                h.release()

    # -- the stages ------------------------------------------------------------------------------

    def hand_off(self, request: RoutedRequest, live: Live,
                 helds: list[_HeldReservation]) -> tuple[HandOffPlan, FirstToken | None]:
        """reserve, plan and prefill (FirstToken None: the decode worker is to prefill locally); when a worker is
        lost before the first token (the prefill worker, the
        decode worker its KV goes to, or every decode worker asked to reserve), release the reservation and
        start again elsewhere, after waiting for a worker that has not just failed if none is left (`workers`),
        MAX_MIGRATIONS times at most. Nothing reached the client yet: a retry costs it only the time."""
        for retries in range(MAX_MIGRATIONS + 1):
            try:
                return self.reserve_and_prefill(request, live, helds, after_loss=retries > 0, may_prefill_locally=True,
                                                admit=retries == 0)
            except WorkerLost as lost:
                if retries == MAX_MIGRATIONS or not live.is_active():
                    raise Failed(grpc.StatusCode.UNAVAILABLE, f"{lost}; {retries} retries already") from None
                log.warning("request=%s event=migrating reason=%s stage=hand_off error=%s", request.request_id,
                            lost.reason, lost)
                self.metrics.request_migrated(lost.reason)
        raise AssertionError("unreachable: the loop returns or raises")

    def reserve(self, request: RoutedRequest, decodes: list[LiveWorker], live: Live,
                history: Sequence[int] = (), lookup: PrefixLookup | None = None) -> Reservation:
        """A reservation on the decode worker that admits the request and holds the most of it for the least
        load (`lookup`: what each holds, from the index; none: load only), the request going with it.
        RESOURCE_EXHAUSTED with a retry hint when every reachable one is full now; FAILED_PRECONDITION (no
        hint: retrying cannot help) when none of them could ever hold the prompt; WorkerLost when none
        answered (the caller waits for one to serve again)."""
        ranked = without(self.rank_decodes(len(request.prompt_token_ids) + len(history), decodes, lookup),
                         self.view.active_suspects())
        by_id = {w.worker_id: w.info for w in decodes}
        num_prompt_tokens = len(request.prompt_token_ids)
        message = wpb.ReserveRequest(
            request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
            sampling=request.built.sampling, cache_salt=request.cache_salt, ttl_s=self.reservation_ttl_s,
            output_token_ids=history,
        )
        exhausted, too_small, pushback_ms = [], [], 0
        for worker_id in ranked:
            info = by_id[worker_id]
            stub = wpb_grpc.DecodeWorkerStub(self.view.channel(info.address))
            try:
                reply = stub.Reserve(message, timeout=min(RESERVE_TIMEOUT_S, live.remaining_s()))
                return Reservation(info, reply.reservation_id, tuple(reply.kv_addresses) or (reply.kv_address,),
                                   reply.num_cached_blocks)
            except grpc.RpcError as e:
                code = e.code()
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    exhausted.append(worker_id)
                    for key, value in e.trailing_metadata() or ():
                        if key == "grpc-retry-pushback-ms":
                            pushback_ms = max(pushback_ms, int(value))
                    continue
                if code == grpc.StatusCode.FAILED_PRECONDITION:
                    too_small.append(e.details())
                    continue
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    raise Failed(code, e.details()) from None
                if not live.is_active() or code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED):
                    self.release_by_request(info, request.request_id)  # it may have reserved after we gave up
                if not live.is_active():
                    raise live.ended() from None
                self.blame(info, e, live)  # unreachable or slow: try the next one
        if exhausted:
            pushback_ms = pushback_ms or DEFAULT_PUSHBACK_MS
            raise Failed(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"no decode worker can admit {num_prompt_tokens} prompt tokens now ({len(exhausted)} full); "
                f"retry after {pushback_ms} ms",
                (("grpc-retry-pushback-ms", str(pushback_ms)),),
            )
        if too_small:
            raise Failed(grpc.StatusCode.FAILED_PRECONDITION,
                         f"no decode worker can ever hold {num_prompt_tokens} prompt tokens: {too_small[0]}")
        raise WorkerLost(DECODE_LOST, f"no decode worker for model {self.model_id} answered")

    def admit(self, request: RoutedRequest, prefills: list[LiveWorker], decodes: list[LiveWorker],
              lookup: PrefixLookup) -> TTFTPrediction:
        """Admission's prediction for a request arriving now (router/admission.py), or Failed(RESOURCE_EXHAUSTED)
        when it would miss the TTFT SLO because of the queue. The decode worker Reserve will most likely pick (the
        best ranked) tells whether it would be prefilled locally; Reserve's real count decides that afterwards."""
        num_prompt_tokens = len(request.prompt_token_ids)
        local = None
        if self.local_prefill_tokens:
            ranked = without(self.rank_decodes(num_prompt_tokens, decodes, lookup), self.view.active_suspects())
            cached_tokens = min(lookup.cached_tokens(ranked[0]), num_prompt_tokens)
            if prefills_locally(num_prompt_tokens, cached_tokens, self.local_prefill_tokens):
                decode = next(w for w in decodes if w.worker_id == ranked[0])
                local = LocalPrefill(decode, num_prompt_tokens - cached_tokens)
        return self.admission.admit(request.request_id, num_prompt_tokens, self.view.healthy(prefills),
                                    self.view.inflight_tokens(), lookup, local)

    def measure_queue(self) -> None:
        """Refresh the prefill queue gauge from the registry's (cached) loads; nothing when no worker is listed."""
        try:
            prefills, _ = self.view.workers()
        except NoWorkers:
            return
        self.admission.measure_queue(prefills, self.view.inflight_tokens())

    def rank_decodes(self, num_tokens: int, decodes: list[LiveWorker], lookup: PrefixLookup | None) -> list[str]:
        """Decode worker ids, best first, by cached overlap and load (router/decode_policy.py)."""
        states = [DecodeState(c.worker_id, lookup.cached_tokens(c.worker_id) if lookup is not None else 0,
                              c.num_requests(), c.num_free_blocks)
                  for c in self.view.candidates(decodes)]
        return rank_decode_by_cache(num_tokens, states)

    def plan(self, request: RoutedRequest, prefills: list[LiveWorker], reservation: Reservation,
             reserve_s: float, history: Sequence[int] = (), lookup: PrefixLookup | None = None,
             prediction: TTFTPrediction | None = None) -> HandOffPlan:
        """The prefill worker for a reserved request: one whose KV layout the decode worker takes, chosen
        by cached prefix (of the prompt, and a migrating request's output so far) and queued work."""
        token_ids = [*request.prompt_token_ids, *history]
        choice = self.choose_prefill(token_ids, request.cache_salt, self.compatible(prefills, reservation.decode),
                                     lookup=lookup)
        predicted = choice.predicted_cached_tokens
        return HandOffPlan(request.request_id, reservation, choice.worker, predicted, len(token_ids) - predicted,
                           reserve_s, prediction)

    def prefill(self, plan: HandOffPlan, request: RoutedRequest, live: Live, history: Sequence[int] = ()) -> FirstToken:
        """P computes the prompt and streams its KV into the reservation; returns once D holds all of it."""
        prefill = plan.prefill
        stub = wpb_grpc.PrefillWorkerStub(self.view.channel(prefill.address))
        self.view.track_tokens(prefill.worker_id, plan.routed_tokens)
        self.view.track_requests(prefill.worker_id, +1)
        try:
            future = stub.Prefill.future(
                wpb.PrefillRequest(request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
                                   sampling=request.built.sampling, cache_salt=request.cache_salt,
                                   target=plan.reservation.kv_target(), output_token_ids=history),
                timeout=live.remaining_s(),
            )
            live.set_call(future)
            first = FirstToken.from_reply(future.result())
            self.admission.transferred(first.kv_transferred_tokens, first.transfer_s)
            return first
        except grpc.FutureCancelledError:
            raise Failed(grpc.StatusCode.CANCELLED, "request cancelled") from None
        except grpc.RpcError as e:
            if live.cancelled or live.aborted:
                raise Failed(grpc.StatusCode.CANCELLED, "request cancelled") from None
            if is_kv_target_fault(e) and live.is_active():  # the decode side failed, not this prefill worker
                self.blame(plan.decode, e, live)
                raise WorkerLost(KV_TRANSFER, f"prefill worker {prefill.worker_id}: {e.details()}") from None
            self.blame(prefill, e, live)
            if e.code() == grpc.StatusCode.UNAVAILABLE and live.is_active() and not is_request_fault(e):
                raise WorkerLost(PREFILL_LOST, f"prefill worker {prefill.worker_id}: {e.details()}") from None
            raise Failed(downstream_code(e), f"prefill worker {prefill.worker_id}: {e.details()}") from None
        finally:
            self.view.track_requests(prefill.worker_id, -1)
            self.view.track_tokens(prefill.worker_id, -plan.routed_tokens)

    def decode_migrating(self, request: RoutedRequest, plan: HandOffPlan, first: FirstToken | None, live: Live,
                         client: ClientStream, helds: list[_HeldReservation]) -> Iterator[pb.GenerateResponse]:
        """The prefill worker's first token (`first`; None: the decode worker prefills locally and streams it),
        `decode`, and when its worker is lost, `migrate` and decode again there (MAX_MIGRATIONS at most)."""
        for migrations in range(MAX_MIGRATIONS + 1):
            try:
                decode_from: int | None = None  # Decode's first token (None: prefill locally)
                if migrations and client.output_token_ids:
                    plan, decode_from = self.migrate(request, client, live, helds)
                elif migrations:  # a local prefill lost before its first token: nothing was sent, start again
                    plan, first = self.reserve_and_prefill(request, live, helds, after_loss=True,
                                                           may_prefill_locally=True)
                if decode_from is None:  # nothing sent yet: this hand-off's reservation is the request's
                    client.usage.decode_cached_tokens = min(plan.reservation.num_cached_tokens,
                                                            len(request.prompt_token_ids))
                if decode_from is None and first is not None:
                    message, done = self.first_token(request, plan, first, client)
                    if done:
                        helds[-1].release()
                        yield self._finish(client, message)
                        return
                    yield message
                    decode_from = first.token_id
                elif decode_from is None:
                    self.metrics.request_prefilled(len(request.prompt_token_ids), plan.predicted_cached_tokens,
                                                   client.usage.decode_cached_tokens)
                yield from self.decode(plan, decode_from, live, client, helds[-1])
                return
            except WorkerLost as lost:
                if migrations == MAX_MIGRATIONS or not live.is_active():
                    raise Failed(grpc.StatusCode.UNAVAILABLE, f"{lost}; {migrations} migrations already") from None
                log.warning("request=%s event=migrating reason=%s from=%s tokens_sent=%d error=%s",
                            request.request_id, lost.reason, plan.decode.worker_id, len(client.output_token_ids),
                            lost)
                self.metrics.request_migrated(lost.reason)

    def first_token(self, request: RoutedRequest, plan: HandOffPlan, first: FirstToken,
                    client: ClientStream) -> tuple[pb.GenerateResponse, bool]:
        """The client message of the prefill worker's token 0 (done: it ends the request); usage and timing noted."""
        self.metrics.request_prefilled(len(request.prompt_token_ids), plan.predicted_cached_tokens, first.cached_tokens)
        client.timing.queue_s, client.timing.prefill_s = first.queue_s, first.prefill_s
        client.timing.transfer_s = first.transfer_s
        client.usage.cached_tokens = first.cached_tokens
        client.usage.kv_transferred_tokens += first.kv_transferred_tokens
        message, done = client.tokens([first.token_id], [first.logprob] if first.logprob is not None else [],
                                      first.finish_reason, first.stop_token_id)
        message.prefill_worker, message.decode_worker = plan.prefill.worker_id, plan.decode.worker_id
        self.first_token_sent(client, plan)
        return message, done

    def first_token_sent(self, client: ClientStream, plan: HandOffPlan) -> None:
        """The request's token 0 goes out now (from a prefill worker, or a decode worker prefilling locally)."""
        client.timing.ttft_s = time.monotonic() - client.received_s
        if plan.prediction is not None:
            client.timing.predicted_ttft_s = plan.prediction.ttft_s
            self.admission.first_token(client.timing.ttft_s, plan.prediction)
        self.metrics.first_token_sent(client.timing.ttft_s, client.timing.predicted_ttft_s)

    def migrate(self, request: RoutedRequest, client: ClientStream, live: Live,
                helds: list[_HeldReservation]) -> tuple[HandOffPlan, int]:
        """The request's KV rebuilt on another decode worker: reserve for the prompt plus every token sent but
        the last, have a prefill worker compute it (its sampled token is dropped: the last one sent stands), and
        return the plan and the token Decode starts from."""
        *history, last = client.output_token_ids
        plan, first = self.reserve_and_prefill(request, live, helds, after_loss=True, history=history)
        assert first is not None, "a migration is never prefilled locally"
        client.usage.kv_transferred_tokens += first.kv_transferred_tokens  # that KV crossed the wire again
        return plan, last

    def reserve_and_prefill(self, request: RoutedRequest, live: Live, helds: list[_HeldReservation],
                            after_loss: bool, history: Sequence[int] = (),
                            may_prefill_locally: bool = False,
                            admit: bool = False) -> tuple[HandOffPlan, FirstToken | None]:
        """One attempt at reserve, plan and prefill (for the prompt plus `history`, a migrating request's
        tokens sent but the last). On WorkerLost its reservation is released: the next attempt reserves afresh.
        No FirstToken (and a plan without a prefill worker) when the decode worker is to prefill locally:
        `may_prefill_locally` (nothing was sent to the client yet) and the uncached part is under
        `local_prefill_tokens`. With `admit` (the request's first attempt), admission judges it first: Failed
        (RESOURCE_EXHAUSTED) before anything is reserved when it would miss the TTFT SLO."""
        prefills, decodes = self.workers(live, after_loss=after_loss)
        reserve_start_s = time.monotonic()
        lookup = self.chooser.lookup([*request.prompt_token_ids, *history], request.cache_salt, [*prefills, *decodes])
        prediction = self.admit(request, prefills, decodes, lookup) if admit else None
        with self.admission.awaiting_prefill(prediction):
            reservation = self.reserve(request, decodes, live, history, lookup)
            held = _HeldReservation(self, reservation)
            helds.append(held)
            num_prompt_tokens = len(request.prompt_token_ids)
            if may_prefill_locally and prefills_locally(num_prompt_tokens, reservation.num_cached_tokens,
                                                        self.local_prefill_tokens):
                # conditional disaggregation: no plan, no prefill worker; D.Decode(prefill_locally) computes the rest
                log.info("request=%s event=local_prefill decode=%s uncached_tokens=%d", request.request_id,
                         reservation.decode.worker_id, num_prompt_tokens - min(reservation.num_cached_tokens,
                                                                               num_prompt_tokens))
                cached_tokens = min(reservation.num_cached_tokens, num_prompt_tokens)
                return HandOffPlan(request.request_id, reservation, None, cached_tokens,
                                   num_prompt_tokens - cached_tokens, time.monotonic() - reserve_start_s,
                                   prediction), None
            try:
                plan = self.plan(request, prefills, reservation, time.monotonic() - reserve_start_s, history, lookup,
                                 prediction)
                return plan, self.prefill(plan, request, live, history)
            except WorkerLost:
                held.release()
                raise

    def decode(self, plan: HandOffPlan, first_token_id: int | None, live: Live, client: ClientStream,
               held: _HeldReservation) -> Iterator[pb.GenerateResponse]:
        """D takes the reserved request with its latest token (None: D prefills it locally, and its first token
        is the stream's) and streams the rest to the client. Raises WorkerLost when D fails through no fault of
        the request (the stream breaks or ends early, D restarted and lost the reservation, or the KV it was sent
        is unusable)."""
        decode = plan.decode
        local = first_token_id is None
        stub = wpb_grpc.DecodeWorkerStub(self.view.channel(decode.address))
        message = wpb.DecodeRequest(reservation_id=plan.reservation.ticket, first_token_id=first_token_id or 0,
                                    prefill_locally=local)
        stream = stub.Decode(message, timeout=live.remaining_s())
        live.set_call(stream)
        prefilling_tokens = plan.routed_tokens if local else 0  # D's prefill work for it, until token 0
        self.view.track_tokens(decode.worker_id, prefilling_tokens)
        try:
            for reply in stream:
                first_message = not client.output_token_ids and bool(reply.token_ids)
                if first_message:  # prefilled locally: token 0 comes from D's stream
                    self.view.track_tokens(decode.worker_id, -prefilling_tokens)
                    prefilling_tokens = 0
                    self.first_token_sent(client, plan)
                elif client.timing.first_decode_s == 0 and reply.token_ids:
                    client.timing.first_decode_s = time.monotonic() - client.received_s - client.timing.ttft_s
                message, done = client.tokens(
                    list(reply.token_ids), list(reply.logprobs), reply.finish_reason,
                    reply.stop_token_id if reply.HasField("stop_token_id") else None,
                )
                if first_message:
                    message.decode_worker = decode.worker_id
                    client.prefilled_locally = local
                if reply.finish_reason:
                    held.taken_over()  # the request ran on the decode worker and ended there
                if done:
                    stream.cancel()  # a stop string: the decode worker aborts and frees the blocks
                    last = self._finish(client, message)
                    break
                if message.token_ids or message.text:
                    yield message
            else:
                raise WorkerLost(DECODE_LOST, f"decode worker {decode.worker_id} ended the stream early")
        except grpc.RpcError as e:
            if live.aborted:
                self.metrics.request_aborted()
                last = client.aborted()
            elif live.cancelled:
                return
            else:
                self.blame(decode, e, live)
                reason = _DECODE_LOST_CODES.get(e.code())
                if reason is not None and live.is_active() and not is_request_fault(e):
                    raise WorkerLost(reason, f"decode worker {decode.worker_id}: {e.code().name}: {e.details()}"
                                     ) from None
                raise Failed(downstream_code(e), f"decode worker {decode.worker_id}: {e.details()}") from None
        finally:
            held.end()
            self.view.track_tokens(decode.worker_id, -prefilling_tokens)
        yield last  # after the accounting above: a client's next turn, sent at once, finds this request gone

    def _finish(self, client: ClientStream, message: pb.GenerateResponse) -> pb.GenerateResponse:
        last = client.finish(message)
        self.metrics.request_completed(last.finish_reason, client.timing.e2e_s, client.timing.ttft_s,
                                       len(client.output_token_ids), client.usage.decode_cached_tokens,
                                       client.usage.kv_transferred_tokens, client.prefilled_locally)
        return last

    # -- helpers ---------------------------------------------------------------------------------

    def blame(self, worker: WorkerInfo, error: grpc.RpcError, live: Live) -> None:
        """Avoid `worker` for a while if `error` is its own fault (unreachable, or slower than a bound the
        router set); never for the request's own: its client's deadline or cancel, or an error the worker
        marked as the request's fault."""
        if live.is_active() and not is_request_fault(error):
            self.view.on_worker_error(worker, error)

    def release_by_request(self, decode: WorkerInfo, request_id: str) -> None:
        """Release what `decode` may hold for `request_id` although its Reserve reply never came. Best effort,
        like `release`; the worker also drops a reservation whose Reserve call was gone when it was made."""
        self._send_release(decode, wpb.ReleaseRequest(request_id=request_id))

    def release(self, reservation: Reservation) -> None:
        """Best effort: if the decode worker is unreachable, the reservation expires there on its own.
        Idempotent on the worker: once Decode took the reservation, Release finds nothing."""
        self._send_release(reservation.decode, wpb.ReleaseRequest(reservation_id=reservation.ticket))

    def _send_release(self, decode: WorkerInfo, message: wpb.ReleaseRequest) -> None:
        stub = wpb_grpc.DecodeWorkerStub(self.view.channel(decode.address))
        try:
            stub.Release(message, timeout=RELEASE_TIMEOUT_S)
        except grpc.RpcError as e:
            log.info("worker=%s event=release_failed reservation=%d request=%s status=%s", decode.worker_id,
                     message.reservation_id, message.request_id, e.code().name)

    def workers(self, live: Live, after_loss: bool = False) -> tuple[list[LiveWorker], list[LiveWorker]]:
        """(prefill, decode) live workers to try. A role with no worker where there was one lately (restarting,
        or re-registering in a restarted Redis), or, `after_loss`, with none that has not just failed a call,
        is waited for, up to worker_wait_s within the client's deadline: a restart costs the request a pause,
        not an error. Past that: UNAVAILABLE when a role has no worker; the suspect ones are tried otherwise
        (a suspect worker beats none). A role never seen fails at once."""
        wait_until_s = time.monotonic() + self.worker_wait_s
        while True:
            try:
                prefills, decodes = self.view.workers()
                if not after_loss or (self.view.any_healthy(prefills) and self.view.any_healthy(decodes)):
                    return prefills, decodes
                missing = None
            except NoWorkers as e:
                if not e.seen_lately:
                    raise Failed(grpc.StatusCode.UNAVAILABLE, str(e)) from None
                missing = e
            if time.monotonic() >= wait_until_s or not live.is_active():
                if missing is not None:
                    raise Failed(grpc.StatusCode.UNAVAILABLE,
                                 f"{missing} (waited {self.worker_wait_s:g} s for one to come back)") from None
                return prefills, decodes
            time.sleep(WORKER_POLL_S)

    def compatible(self, prefills: list[LiveWorker], decode: WorkerInfo) -> list[LiveWorker]:
        """The prefill workers whose KV layout (model, dtype, block size, TP size, draft model) the decode worker takes;
        FAILED_PRECONDITION naming the mismatch when there is none."""
        fits = [w for w in prefills
                if not w.info.kv_layout or not decode.kv_layout or w.info.kv_layout == decode.kv_layout]
        if prefills and not fits:
            raise Failed(grpc.StatusCode.FAILED_PRECONDITION,
                         f"no prefill worker can send KV to decode worker {decode.worker_id} (tp_size="
                         f"{decode.tp_size}): prefill workers run tp_size {sorted({w.info.tp_size for w in prefills})} "
                         "or another KV layout; prefill and decode workers need the same --tp, dtype, block size and "
                         "draft model (--speculative-config)")
        return fits

    def choose_prefill(self, prompt_token_ids: list[int], cache_salt: str, prefills: list[LiveWorker],
                       speculate: bool = True, lookup: PrefixLookup | None = None) -> PrefillChoice:
        return self.chooser.choose(prompt_token_ids, cache_salt, self.view.healthy(prefills),
                                   self.view.inflight_tokens(), speculate=speculate, lookup=lookup)

    def preview(self, built: BuiltRequest, cache_salt: str) -> RoutePreview:
        """Where `built` would go now (no reservation, no speculative entry)."""
        try:
            prefills, decodes = self.view.workers()
        except NoWorkers as e:
            raise Failed(grpc.StatusCode.UNAVAILABLE, str(e)) from None
        lookup = self.chooser.lookup(built.prompt_token_ids, cache_salt, [*prefills, *decodes])
        choice = self.choose_prefill(built.prompt_token_ids, cache_salt, prefills, speculate=False, lookup=lookup)
        return RoutePreview(choice, self.rank_decodes(len(built.prompt_token_ids), decodes, lookup)[0], prefills)
