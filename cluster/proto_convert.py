"""Conversions between protobuf messages and engine objects, shared by the router and the workers.

Absent optional fields take the engine's defaults; a bad value raises `InvalidRequestError` whose field
names the proto path (e.g. `sampling.top_p`), which servers turn into INVALID_ARGUMENT.
"""

from __future__ import annotations

from duet.v1 import generation_pb2 as pb
from engine.errors import InvalidRequestError
from engine.sampler import TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutput

_OPTIONAL = (
    "max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "seed", "logprobs", "skip_special_tokens", "min_tokens",
)


def sampling_from_proto(msg: pb.SamplingParams, prefix: str = "sampling.") -> SamplingParams:
    kwargs: dict = {name: getattr(msg, name) for name in _OPTIONAL if msg.HasField(name)}
    kwargs.update(
        stop=list(msg.stop),
        stop_token_ids=list(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        include_stop_str_in_output=msg.include_stop_str_in_output,
        logit_bias=dict(msg.logit_bias),
    )
    try:
        if msg.HasField("structured_output"):
            kwargs["structured_output"] = structured_output_from_proto(msg.structured_output)
        return SamplingParams(**kwargs)
    except InvalidRequestError as e:
        raise InvalidRequestError(prefix + e.field, e.value, e.allowed) from None


def structured_output_from_proto(msg: pb.StructuredOutput) -> StructuredOutput:
    """InvalidRequestError (field `structured_output...`) when no kind is set or the one set is invalid."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        raise InvalidRequestError("structured_output", "{}", "one of json_schema, json_object, regex, choice, "
                                  "grammar must be set")
    if kind == "choice":
        return StructuredOutput(choice=tuple(msg.choice.choices))
    return StructuredOutput(**{kind: getattr(msg, kind)})


def structured_output_to_proto(spec: StructuredOutput) -> pb.StructuredOutput:
    if spec.choice is not None:
        return pb.StructuredOutput(choice=pb.Choice(choices=spec.choice))
    return pb.StructuredOutput(**{spec.kind: getattr(spec, spec.kind)})


def sampling_to_proto(params: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        stop=params.stop,
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
        include_stop_str_in_output=params.include_stop_str_in_output,
        skip_special_tokens=params.skip_special_tokens,
        logit_bias=params.logit_bias,
        min_tokens=params.min_tokens,
    )
    if params.seed is not None:
        msg.seed = params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    if params.structured_output is not None:
        msg.structured_output.CopyFrom(structured_output_to_proto(params.structured_output))
    return msg


def logprobs_to_proto(lp: TokenLogprobs) -> pb.TokenLogprob:
    return pb.TokenLogprob(
        token_id=lp.token_id,
        logprob=lp.logprob,
        rank=lp.rank,
        top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
    )


def logprobs_from_proto(msg: pb.TokenLogprob) -> TokenLogprobs:
    return TokenLogprobs(msg.token_id, msg.logprob, msg.rank, [(t.token_id, t.logprob) for t in msg.top])
