"""kvtransfer: moves paged KV blocks from a prefill worker's cache into blocks a decode worker reserved.

    decode side                                   prefill side
    ReservationTable.add(request, block_ids)  ─▶  reservation id travels with the request (router)
    KVReceiver(layout, kv_caches, table)     ◀──  KVSender.send(endpoint, reservation_id, layers, blocks)
    ReservationTable.wait_complete / pop           one message per layer group, acked

See layout.py (what must match), messages.py (wire format), reservation.py (decode-side bookkeeping),
sender.py + channel.py and receiver.py + write_stream.py (the two ends), block_copy.py (cache <-> message
buffer), process_group.py (the torch.distributed transport).
"""

from kvtransfer.errors import (
    ChecksumMismatch,
    LayoutMismatch,
    PeerGone,
    ProtocolError,
    ReservationExpired,
    TransferError,
    TransferTimeout,
)
from kvtransfer.layout import KVLayout, LayerShape
from kvtransfer.receiver import KVReceiver
from kvtransfer.reservation import Reservation, ReservationTable
from kvtransfer.sender import KVSender

__all__ = [
    "ChecksumMismatch", "KVLayout", "KVReceiver", "KVSender", "LayerShape", "LayoutMismatch", "PeerGone",
    "ProtocolError",
    "Reservation", "ReservationExpired", "ReservationTable", "TransferError", "TransferTimeout",
]
