"""The protobufs the front end answers with, made from what the engine core reports (the core
sends plain structs: service.protocol's CacheCounters and ModelInfo, whose field names are the
responses')."""

from __future__ import annotations

import msgspec

from mlxserve.v1 import generation_pb2 as pb
from service.protocol import AdapterDescription, CacheCounters, ModelInfo

_SLOT_STATE = {"prefilling": pb.SLOT_STATE_PREFILLING, "decoding": pb.SLOT_STATE_DECODING}


def cache_stats_response(counters: CacheCounters) -> pb.CacheStatsResponse:
    fields = msgspec.structs.asdict(counters)
    slots = fields.pop("slots")
    fields.pop("grammar")  # for the metrics only
    fields.pop("steps")
    response = pb.CacheStatsResponse(**fields)
    response.slots.extend(
        pb.SlotInfo(
            request_id=s.request_id,
            state=_SLOT_STATE[s.state],
            generated_tokens=s.generated_tokens,
            context_tokens=s.context_tokens,
            priority=s.priority,
            adapter=s.adapter,
        )
        for s in slots
    )
    return response


def model_info_response(info: ModelInfo) -> pb.GetModelInfoResponse:
    fields = msgspec.structs.asdict(info)
    quantization = msgspec.structs.asdict(fields.pop("quantization"))
    speculation = msgspec.structs.asdict(fields.pop("speculation"))
    structured = msgspec.structs.asdict(fields.pop("structured_output"))
    adapters = fields.pop("adapters")
    return pb.GetModelInfoResponse(
        **fields,
        quantization=pb.Quantization(**quantization),
        speculation=pb.Speculation(**speculation),
        structured_output=pb.StructuredOutput(**structured),
        adapters=[adapter_info(a) for a in adapters],
    )


def adapter_info(adapter: AdapterDescription) -> pb.AdapterInfo:
    return pb.AdapterInfo(**msgspec.structs.asdict(adapter))
