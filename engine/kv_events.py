"""KV-cache events on a ZMQ socket, in the wire format of vLLM's `--kv-events-config` publisher.

What llm-d's KV-cache indexer and other cache-aware routers subscribe to: every step that changed the prefix cache
becomes one msgpack batch `[timestamp, [event, ...], data_parallel_rank]`, sent as the multipart message
`[topic, sequence number (8 bytes, big-endian), batch]`. Events are `BlockStored`, `BlockRemoved` and
`AllBlocksCleared`, as tagged maps (vLLM's current encoding) or positional arrays (`format="array"`, what vLLM sent
before it dropped msgspec's array_like, and what some consumers still decode). Block hashes are the allocator's
own (kvcache/block_hash.py: vLLM's sha256_cbor scheme), as their low 64 bits (vLLM's default) or all 32 bytes.

A ROUTER socket replays the last `replay_batches` batches to a subscriber that missed some: it sends an empty frame
and the first sequence number it wants (8 bytes, big-endian) and gets each batch as `[b"", topic, sequence,
batch]`, then `[b"", b"", -1 (8 bytes, signed), b""]`.

The engine step only puts its events on a bounded queue; a thread encodes and sends them. When the queue is full
the step drops the batch and counts its events (`num_dropped_events`): the engine never waits for a subscriber.
A dropped batch still takes its sequence number, so subscribers see the gap (which no replay can fill: an indexer
then knows its picture of this replica is incomplete), as they do when ZMQ's high-water mark drops a message. The first
batch, sequence 0, is `AllBlocksCleared`: a replica that restarts tells the indexer its old blocks are gone.
"""

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Literal

import msgpack
import zmq

from kvserve.kvcache.block_hash import ExtraKeys, low_64_bits
from kvserve.kvcache.events import AllBlocksCleared, BlocksRemoved, BlocksStored, CacheEvent

logger = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
_POLL_S = 0.05


@dataclass(frozen=True)
class KVEventsConfig:
    """Where and how the events go. An endpoint with `*` (or an ipc/inproc one) is bound; any other is connected
    to, e.g. a subscriber that binds (llm-d's endpoint picker does)."""

    endpoint: str
    block_size: int
    medium: str  # where the blocks live: "GPU" on CUDA (vLLM's name for its device cache), else "CPU"
    replay_endpoint: str | None = None
    topic: str = ""
    queue_size: int = 1000  # batches waiting to be sent before a step drops its own
    replay_batches: int = 10_000
    format: Literal["map", "array"] = "map"
    int_hashes: bool = True


class KVEventPublisher:
    """Publishes the allocator's events; `publish` is called on the engine thread and never blocks."""

    def __init__(self, config: KVEventsConfig, context: zmq.Context | None = None) -> None:
        self.config = config
        self.num_dropped_events = 0  # engine thread only
        self._context = context or zmq.Context.instance()
        self._pub = self._context.socket(zmq.PUB)
        self._replay = None
        try:
            _bind_or_connect(self._pub, config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as error:
            self._close_sockets()
            endpoints = f"{config.endpoint!r} / {config.replay_endpoint!r}"
            raise ValueError(f"kv events: cannot open {endpoints}: {error}") from None
        self._queue: queue.Queue[tuple[int, float, list[CacheEvent]] | None] = queue.Queue(config.queue_size)
        self._sent: deque[tuple[int, bytes]] = deque(maxlen=config.replay_batches)
        self._topic = config.topic.encode()
        self._next_seq = 0  # the engine thread's: every batch takes one, sent or dropped
        self.publish([AllBlocksCleared()])
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[CacheEvent]) -> None:
        """Queue one step's events; if the queue is full they are dropped and counted."""
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        try:
            self._queue.put_nowait((seq, time.time(), events))
        except queue.Full:
            self.num_dropped_events += len(events)

    def close(self, timeout_s: float = 1.0) -> None:
        """Send what is queued (for at most `timeout_s`), then close the sockets."""
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=timeout_s)
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        while True:
            try:
                if self._replay is not None and self._replay.poll(0):
                    self._answer_replay()
            except Exception:
                logger.exception("kv events: a replay request could not be answered")
            try:
                item = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if item is None:
                return
            try:
                self._send(*item)
            except Exception:
                logger.exception("kv events: a batch could not be sent")

    def _send(self, seq: int, timestamp: float, events: list[CacheEvent]) -> None:
        payload = msgpack.packb([timestamp, [self._encode(event) for event in events], 0])
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._sent.append((seq, payload))

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("kv events: ignoring a malformed replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        first_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._sent):
            if seq >= first_seq:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_OF_REPLAY, b""))

    def _encode(self, event: CacheEvent) -> dict | list:
        medium = self.config.medium
        if isinstance(event, BlocksStored):
            parent = None if event.parent_block_hash is None else self._hash(event.parent_block_hash)
            fields = {
                "block_hashes": [self._hash(digest) for digest in event.block_hashes],
                "parent_block_hash": parent,
                "token_ids": list(event.token_ids),
                "block_size": self.config.block_size,
                "lora_id": event.lora_id,
                "medium": medium,
                "lora_name": event.lora_name,
            }
            if self.config.format == "map":
                fields["extra_keys"] = [_published_extra_keys(keys) for keys in event.extra_keys]
                fields["group_idx"] = 0
                fields["kv_cache_spec_kind"] = "full_attention"
            return self._tagged("BlockStored", fields)
        if isinstance(event, BlocksRemoved):
            fields = {"block_hashes": [self._hash(digest) for digest in event.block_hashes], "medium": medium}
            if self.config.format == "map":
                fields["group_idx"] = 0
            return self._tagged("BlockRemoved", fields)
        return self._tagged("AllBlocksCleared", {})

    def _tagged(self, tag: str, fields: dict) -> dict | list:
        if self.config.format == "map":
            return {"type": tag, **fields}
        return [tag, *fields.values()]

    def _hash(self, digest: bytes) -> int | bytes:
        return low_64_bits(digest) if self.config.int_hashes else digest


def _published_extra_keys(keys: ExtraKeys) -> tuple | None:
    # Published untagged, as vLLM publishes them: ("cache_salt", "a") is sent as "a".
    return None if keys is None else tuple(key[1] for key in keys)


def _bind_or_connect(socket: zmq.Socket, endpoint: str) -> None:
    if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        socket.bind(endpoint)
    else:
        socket.connect(endpoint)
