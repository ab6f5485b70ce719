"""HTTP/2's wire format as gateway/epp/h2.py needs it (RFC 9113 frames, RFC 7541 header blocks), and
gRPC's status codes and trailers."""

from __future__ import annotations

import struct
from urllib.parse import quote

import hpack

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM = ACK = 0x1
END_HEADERS, PADDED, PRIORITY_FLAG = 0x4, 0x8, 0x20
NO_ERROR, PROTOCOL_ERROR, FLOW_CONTROL_ERROR, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR = (
    0, 1, 3, 6, 7, 8, 9)
HEADER_TABLE_SIZE, MAX_CONCURRENT, INITIAL_WINDOW, MAX_FRAME = 1, 3, 4, 5
# gRPC status codes (grpc/doc/statuscodes.md)
OK, UNKNOWN, NOT_FOUND, RESOURCE_EXHAUSTED, FAILED_PRECONDITION, UNIMPLEMENTED, INTERNAL = 0, 2, 5, 8, 9, 12, 13

DEFAULT_WINDOW = 65_535
RECEIVE_WINDOW = 1 << 22  # 4 MiB a stream: a 2K-token body (8 KB) never waits for a window update
MAX_FRAME_SIZE = 1 << 20  # what we accept; a large body arrives in few frames
MAX_STREAMS = 1024
MAX_HEADER_LIST = 64 * 1024
FRAME_HEADER = struct.Struct(">IBI")  # length << 8 | type, flags, stream id (and the reserved bit)


def _integer(value: int, prefix_bits: int, first: int) -> bytes:
    """An HPACK integer (RFC 7541 5.1) with `first`'s high bits as the pattern."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out, value = bytearray([first | limit]), value - limit
    while value >= 128:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_headers(headers: list[tuple[str, str]]) -> bytes:
    """A header block of literals without indexing (RFC 7541 6.2.2): stateless, so the same bytes on
    every stream and nothing to keep in step with the peer's dynamic table."""
    out = bytearray()
    for name, value in headers:
        n, v = name.encode(), value.encode("latin-1")
        out += b"\x00" + _integer(len(n), 7, 0) + n + _integer(len(v), 7, 0) + v
    return bytes(out)


Frame = tuple[int, int, int, bytes]  # type, flags, stream id, payload


def split_frames(buf: bytes) -> tuple[list[Frame], bytes]:
    """The whole frames at the start of `buf`, and what is left of it (a frame still arriving). For
    clients that read a few frames (the benchmark's, the tests'); the server parses in place."""
    frames, at = [], 0
    while len(buf) - at >= 9:
        head, flags, sid = FRAME_HEADER.unpack_from(buf, at)
        end = at + 9 + (head >> 8)
        if len(buf) < end:
            break
        frames.append((head & 0xFF, flags, sid & 0x7FFFFFFF, buf[at + 9:end]))
        at = end
    return frames, buf[at:]


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return FRAME_HEADER.pack(len(payload) << 8 | kind, flags, stream_id) + payload


RESPONSE_HEADERS = b"\x88" + encode_headers([("content-type", "application/grpc"),  # 0x88: ":status: 200"
                                             ("grpc-accept-encoding", "identity")])
_GRPC_MESSAGE_SAFE = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%")  # grpc's percent-encoding


def trailers(code: int, message: str = "") -> bytes:
    fields = [("grpc-status", str(code))]
    if message:  # cut: one HEADERS frame, whatever the message echoes (a path, say)
        fields.append(("grpc-message", quote(message[:1024], safe=_GRPC_MESSAGE_SAFE)))
    return encode_headers(fields)


class HeaderDecoder:
    """hpack's decoder, remembering the blocks that did not change its dynamic table: a data plane
    indexes a stream's headers once, and every later stream sends the same few index bytes, whose
    meaning stays the same until the table changes (when the memory is cleared). Decoding them again
    cost about 10 % of a pick's CPU here."""

    def __init__(self, max_header_list: int, remembered: int = 64) -> None:
        self.hpack = hpack.Decoder()
        self.hpack.max_header_list_size = max_header_list
        self.remembered = remembered
        self.known: dict[bytes, dict[bytes, bytes]] = {}

    def _table(self) -> tuple[int, int, object]:
        entries = self.hpack.header_table.dynamic_entries
        return self.hpack.header_table.maxsize, len(entries), entries[0] if entries else None

    def decode(self, block: bytes) -> dict[bytes, bytes]:
        """The block's headers (the last of a repeated name); the same dict for the same block."""
        headers = self.known.get(block)
        if headers is not None:
            return headers
        before = self._table()
        headers = dict(self.hpack.decode(block, raw=True))
        after = self._table()
        if after[:2] != before[:2] or after[2] is not before[2]:  # an entry added (a new tuple) or evicted
            self.known.clear()
        elif len(self.known) < self.remembered:
            self.known[block] = headers
        return headers
