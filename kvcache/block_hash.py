"""Prefix-cache block hashes, computed as vLLM computes them with its `sha256_cbor` algorithm.

A full block's hash is SHA-256 over the canonical CBOR encoding of `[parent hash, token ids, extra keys]`; the
first block's parent is SHA-256 over the CBOR of a seed string (vLLM's `NONE_HASH`: `$PYTHONHASHSEED` when set,
else "vllm-none-hash"). Extra keys tag what besides the tokens decides a block's K and V: the LoRA adapter on every
block, as `("lora", name, path)`, then a cache salt on the first block, as `("cache_salt", salt)`. With the same
scheme and seed, a router that only sees tokens (llm-d's KV-cache indexer, a router fed by KV-cache events)
predicts which blocks a replica holds.

The encoder covers only what a block key holds (unsigned ints, text, bytes, None, arrays), in CBOR's canonical
(shortest) form; RFC 8949 section 4.2.1.
"""

import hashlib
import os
import struct
from dataclasses import dataclass

DEFAULT_HASH_SEED = "vllm-none-hash"
ExtraKeys = tuple[tuple[str, ...], ...] | None

_UINT16 = struct.Struct(">BH")
_UINT32 = struct.Struct(">BI")
_UINT64 = struct.Struct(">BQ")


class _TokenEncodings(dict):
    """Token id -> its CBOR bytes, filled on first use: a block is hashed every time a prompt is looked up, and a
    lookup is 3x faster than encoding (a vocabulary's worth is a few MB)."""

    def __missing__(self, token_id: int) -> bytes:
        encoded = self[token_id] = _uint(token_id)
        return encoded


_TOKEN_BYTES = _TokenEncodings()


def resolve_hash_seed(configured: str | None, environ: dict | None = None) -> str:
    """The seed of the first block's parent: `configured`, else `$PYTHONHASHSEED` (as vLLM reads it), else vLLM's
    default."""
    if configured is not None:
        return configured
    environ = os.environ if environ is None else environ
    return environ.get("PYTHONHASHSEED", DEFAULT_HASH_SEED)


def none_hash(seed: str) -> bytes:
    """The parent hash of a chain's first block."""
    return hashlib.sha256(cbor_encode(seed)).digest()


def block_hash(parent_hash: bytes, token_ids: tuple[int, ...], extra_keys: ExtraKeys = None) -> bytes:
    """The hash of a full block holding `token_ids` after the prefix whose hash is `parent_hash`."""
    tokens = b"".join(map(_TOKEN_BYTES.__getitem__, token_ids))
    encoded = b"".join(
        (b"\x83", _head(2, len(parent_hash)), parent_hash, _head(4, len(token_ids)), tokens, cbor_encode(extra_keys))
    )
    return hashlib.sha256(encoded).digest()


def low_64_bits(digest: bytes) -> int:
    """A hash as the integer vLLM publishes by default (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`): its last 8 bytes,
    big-endian."""
    return int.from_bytes(digest[-8:], "big")


def cbor_encode(value: object) -> bytes:
    """Canonical CBOR of None, a non-negative int, str, bytes, or a tuple/list of those."""
    if value is None:
        return b"\xf6"
    if isinstance(value, bool):
        raise TypeError("booleans are not part of a block key")
    if isinstance(value, int):
        return _uint(value)
    if isinstance(value, str):
        data = value.encode()
        return _head(3, len(data)) + data
    if isinstance(value, bytes):
        return _head(2, len(value)) + value
    if isinstance(value, tuple | list):
        return _head(4, len(value)) + b"".join(map(cbor_encode, value))
    raise TypeError(f"cannot encode {type(value).__name__} in a block key")


def _uint(value: int) -> bytes:
    if value < 0:
        raise ValueError(f"token ids are non-negative, got {value}")
    return _head(0, value)


def _head(major: int, argument: int) -> bytes:
    """A data item's initial bytes: its major type and the shortest encoding of its argument."""
    top = major << 5
    if argument < 24:
        return bytes([top | argument])
    if argument < 1 << 8:
        return bytes([top | 24, argument])
    if argument < 1 << 16:
        return _UINT16.pack(top | 25, argument)
    if argument < 1 << 32:
        return _UINT32.pack(top | 26, argument)
    return _UINT64.pack(top | 27, argument)


@dataclass(frozen=True, slots=True)
class BlockKey:
    """What a full block holds: its token ids and extra keys, after the prefix whose hash is `parent_digest` (None
    for a sequence's first block); `digest` is the block's hash, computed once by `BlockHasher.key`."""

    parent_digest: bytes | None
    token_ids: tuple[int, ...]
    extra_keys: ExtraKeys
    digest: bytes


class BlockHasher:
    """Makes block keys under one seed: every replica that should predict another's cache uses the same seed."""

    def __init__(self, seed: str = DEFAULT_HASH_SEED) -> None:
        self.seed = seed
        self.none_hash = none_hash(seed)

    def key(self, parent: "BlockKey | None", token_ids: tuple[int, ...], extra_keys: ExtraKeys = None) -> BlockKey:
        parent_digest = parent.digest if parent is not None else None
        digest = block_hash(parent_digest or self.none_hash, token_ids, extra_keys)
        return BlockKey(parent_digest, token_ids, extra_keys, digest)


def cache_salt_keys(cache_salt: str | None) -> ExtraKeys:
    """The first block's extra keys for a request with `cache_salt` (vLLM's tagging): requests with different
    salts never share a block, so tenants can keep their caches apart."""
    return (("cache_salt", cache_salt),) if cache_salt else None


@dataclass(frozen=True, slots=True)
class AdapterTag:
    """The LoRA adapter a request runs under. `adapter_id` tells loads apart (a name unloaded and loaded again gets a
    new one); the name and path go into its blocks' keys, as vLLM puts them."""

    adapter_id: int
    name: str
    path: str


def block_extra_keys(first_block: bool, cache_salt: str | None, lora: AdapterTag | None) -> ExtraKeys:
    """A block's extra keys, in vLLM's order: the LoRA adapter on every block, so no adapter reuses another's (or the
    base model's) K and V; the cache salt on the first."""
    keys = (("lora", lora.name, lora.path),) if lora is not None else ()
    salt = cache_salt_keys(cache_salt) if first_block else None
    return (keys + salt if salt else keys) or None
