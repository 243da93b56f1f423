"""A KV-cache events subscriber written from the published format (vLLM's), as a router's indexer would be.

It decodes batches with msgspec structs declared from the format (tagged maps, the batch a positional array),
fills gaps in the sequence numbers from the replay socket, and keeps an index of the blocks the publisher holds.
"""

import time

import msgspec
import zmq

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


class BlockStored(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[list[str] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    pass


class EventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


DECODER = msgspec.msgpack.Decoder(EventBatch)


class Subscriber:
    """SUB on `endpoint` (and DEALER on `replay_endpoint`); `payloads` maps sequence numbers to raw batches."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, bind: bool = False) -> None:
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        (self.sub.bind if bind else self.sub.connect)(endpoint)
        self.replay_socket = None
        if replay_endpoint is not None:
            self.replay_socket = self.context.socket(zmq.DEALER)
            self.replay_socket.connect(replay_endpoint)
        self.payloads: dict[int, bytes] = {}
        self.topics: set[bytes] = set()

    def receive(self, timeout_s: float) -> int:
        """Take what arrives within `timeout_s` (returning as soon as nothing more is waiting); how many."""
        count, deadline = 0, time.monotonic() + timeout_s
        while self.sub.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            topic, seq, payload = self.sub.recv_multipart()
            self.topics.add(topic)
            self.payloads[int.from_bytes(seq, "big")] = payload
            count += 1
            deadline = min(deadline, time.monotonic() + 0.05)
        return count

    def replay(self, first_seq: int, timeout_s: float = 5.0) -> list[int]:
        """Ask for every kept batch from `first_seq` on; the sequence numbers that came back."""
        self.replay_socket.send_multipart((b"", first_seq.to_bytes(8, "big")))
        got = []
        while True:
            assert self.replay_socket.poll(int(timeout_s * 1000)), "no answer from the replay socket"
            _, topic, seq, payload = self.replay_socket.recv_multipart()
            if seq == END_OF_REPLAY:
                return got
            self.topics.add(topic)
            self.payloads[int.from_bytes(seq, "big")] = payload
            got.append(int.from_bytes(seq, "big"))

    def missing(self) -> list[int]:
        """Sequence numbers below the highest received that have not arrived."""
        if not self.payloads:
            return []
        return [seq for seq in range(max(self.payloads)) if seq not in self.payloads]

    def batches(self) -> list[EventBatch]:
        """Every batch received so far, in sequence order; there must be no gap."""
        assert not self.missing(), f"missing batches {self.missing()}"
        return [DECODER.decode(self.payloads[seq]) for seq in sorted(self.payloads)]

    def close(self) -> None:
        self.context.destroy(linger=0)


def index_of(batches: list[EventBatch]) -> set[int | bytes]:
    """The block hashes the publisher holds after `batches`, as an indexer would track them."""
    held: set[int | bytes] = set()
    for batch in batches:
        for event in batch.events:
            if isinstance(event, BlockStored):
                held.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                held.difference_update(event.block_hashes)
            else:
                held.clear()
    return held
