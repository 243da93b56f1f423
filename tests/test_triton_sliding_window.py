"""Sliding-window attention and score soft-capping (Gemma 2 and 3) in the Triton decode and extend kernels equal
the torch reference. Windows are not multiples of the block size (4), and every block wholly before a request's
window is poisoned with NaN (an int8 cache: its scales), so a kernel that reads one fails. Without a GPU the
kernels run in Triton's interpreter, so shapes stay small."""

import pytest
import torch

from kvserve.kernels import AttentionShape, PagedKV, paged_attention, select_backend
from kvserve.kernels.torch_paged_attention import first_visible_position
from kvserve.kernels.triton_decode_attention import DecodeWorkspace, paged_decode_attention
from kvserve.kernels.triton_extend_attention import paged_extend_attention
from tests.paged_batches import BLOCK_SIZE, HEAD_DIM, PagedBatch, assert_close, make_batch, poisoned_like
from tests.test_triton_kernels import DEVICE

SCALE = HEAD_DIM**-0.5
# With a window, padding rows of a request's last query tile (past its new tokens) may see no key: the
# interpreter warns of their 0 / 0, which is never stored (assert_close checks every stored row).
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")
# Decodes first (as the scheduler orders them), then a whole prompt, chunks after a context and a one-token chunk.
MIXED_QUERY_LENS = [1, 1, 1, 6, 9, 1]
MIXED_SEQ_LENS = [3, 22, 41, 6, 30, 13]


def expected(batch: PagedBatch, window: int | None, softcap: float | None) -> torch.Tensor:
    """The torch path on fp32 copies, computed before the poisoning."""
    cache = batch.cache
    if not cache.quantized:
        cache = PagedKV(cache.key.float(), cache.value.float())
    return paged_attention(batch.query.float(), cache, batch.metadata, SCALE, window, softcap)


def poison_blocks_before_windows(batch: PagedBatch, window: int) -> int:
    """NaN in every block that ends before the first position a request's queries see; returns how many."""
    cache, metadata = batch.cache, batch.metadata
    poisoned = (cache.key_scale, cache.value_scale) if cache.quantized else (cache.key, cache.value)
    num_blocks = 0
    for i, (query_len, seq_len) in enumerate(zip(metadata.query_lens_cpu, metadata.seq_lens_cpu, strict=True)):
        blocks = metadata.block_tables[i, : first_visible_position(seq_len, query_len, window) // BLOCK_SIZE].long()
        for tensor in poisoned:
            tensor[blocks] = float("nan")
        num_blocks += len(blocks)
    return num_blocks


def decode(batch: PagedBatch, window, softcap, num_segments: int) -> tuple[torch.Tensor, DecodeWorkspace]:
    num_seqs, num_heads, head_dim = batch.query.shape
    workspace = DecodeWorkspace.allocate(num_seqs, num_heads, head_dim, max_segments=4, device=DEVICE)
    out = poisoned_like(batch.query)
    meta = batch.metadata
    paged_decode_attention(
        batch.query, batch.cache, meta.block_tables, meta.seq_lens, SCALE, num_segments, workspace, out, block_n=16,
        sliding_window=window, logit_softcap=softcap,
    )  # fmt: skip
    return out, workspace


def extend(batch: PagedBatch, window, softcap, block_m: int) -> torch.Tensor:
    out = poisoned_like(batch.query)
    meta = batch.metadata
    paged_extend_attention(
        batch.query, batch.cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, SCALE, 0, meta.num_seqs,
        meta.max_query_len, out, block_m=block_m, block_n=16, sliding_window=window, logit_softcap=softcap,
    )  # fmt: skip
    return out


def backend_attention(batch: PagedBatch, window, softcap) -> torch.Tensor:
    num_heads, head_dim = batch.query.shape[1:]
    backend = select_backend("triton", DEVICE, AttentionShape(8, num_heads, head_dim))
    return backend.paged_attention(batch.query, batch.cache, batch.metadata, SCALE, window, softcap)


@pytest.mark.parametrize("window", [1, 3, 5])
@pytest.mark.parametrize("softcap", [None, 2.5])
def test_decode_reads_only_its_window(window, softcap):
    seq_lens = [1, 3, 6, 13, 22, 41]
    batch = make_batch([1] * len(seq_lens), seq_lens, 8, 2, torch.float32, seed=10)
    want = expected(batch, window, softcap)
    assert poison_blocks_before_windows(batch, window) > 0
    for num_segments in (1, 3):
        assert_close(decode(batch, window, softcap, num_segments)[0], want, torch.float32)


def test_decode_segments_split_the_window_not_the_sequence():
    # 40 visible positions of 90 in two segments of 32 and 8 (16-token tiles): both hold visible keys, where
    # splitting all 90 positions would give segment 0 nothing but positions before the window.
    batch = make_batch([1], [90], 4, 2, torch.float32, seed=11)
    want = expected(batch, 40, None)
    poison_blocks_before_windows(batch, 40)
    out, workspace = decode(batch, 40, None, num_segments=2)
    assert_close(out, want, torch.float32)
    assert workspace.partial_lse[0, :, :2].isfinite().all()


@pytest.mark.parametrize(("window", "softcap"), [(3, None), (5, 2.5), (3, 2.5), (20, None)])
@pytest.mark.parametrize("block_m", [16, 32])
def test_extend_reads_only_its_window(window, softcap, block_m):
    # A whole prompt, chunks after a context, one token after a context, and 35 rows spanning query tiles; with
    # 32-row tiles over 16-key tiles a tile's last rows see nothing in its first key tiles.
    query_lens, seq_lens = [5, 7, 1, 35], [5, 19, 10, 60]
    batch = make_batch(query_lens, seq_lens, 6, 2, torch.float32, seed=12)
    want = expected(batch, window, softcap)
    assert poison_blocks_before_windows(batch, window) > 0
    assert_close(extend(batch, window, softcap, block_m), want, torch.float32)


@pytest.mark.parametrize(("window", "softcap"), [(5, None), (3, 2.5), (None, 2.5), (64, None)])
def test_backend_runs_windowed_and_capped_decodes_and_extends_of_one_step(window, softcap):
    batch = make_batch(MIXED_QUERY_LENS, MIXED_SEQ_LENS, 8, 2, torch.float32, seed=13)
    want = expected(batch, window, softcap)
    if window is not None and window < 64:
        assert poison_blocks_before_windows(batch, window) > 0
    assert_close(backend_attention(batch, window, softcap), want, torch.float32)


def test_backend_windowed_and_capped_in_bf16():
    batch = make_batch(MIXED_QUERY_LENS, MIXED_SEQ_LENS, 8, 2, torch.bfloat16, seed=14)
    want = expected(batch, 5, 2.5)
    poison_blocks_before_windows(batch, 5)
    out = backend_attention(batch, 5, 2.5)
    assert out.dtype == torch.bfloat16
    assert_close(out, want, torch.bfloat16)


def test_backend_windowed_and_capped_on_an_int8_cache():
    # The cap applies to the scores with the K scales folded in, as the torch path computes them.
    batch = make_batch(MIXED_QUERY_LENS, MIXED_SEQ_LENS, 8, 2, torch.float32, seed=15, int8=True)
    want = expected(batch, 3, 2.5)
    assert poison_blocks_before_windows(batch, 3) > 0
    out = backend_attention(batch, 3, 2.5)
    assert not out.isnan().any()
    torch.testing.assert_close(out.cpu(), want.cpu(), atol=1e-4, rtol=0)


def test_capping_holds_scores_far_past_the_cap():
    # Scores in the hundreds against a cap of 1: tanh saturates at +-1 without overflow.
    batch = make_batch(MIXED_QUERY_LENS, MIXED_SEQ_LENS, 4, 4, torch.float32, seed=16)
    batch.query.mul_(200.0)
    want = expected(batch, None, 1.0)
    assert_close(backend_attention(batch, None, 1.0), want, torch.float32)


@pytest.mark.parametrize(
    ("window", "softcap", "message"),
    [(0, None, "at least 1"), (None, 0.0, "positive"), (None, -1.0, "got -1")],
)
def test_kernels_refuse_empty_windows_and_non_positive_caps(window, softcap, message):
    batch = make_batch([1], [5], 4, 4, torch.float32)
    with pytest.raises(ValueError, match=message):
        decode(batch, window, softcap, num_segments=1)
    with pytest.raises(ValueError, match=message):
        extend(batch, window, softcap, block_m=16)
