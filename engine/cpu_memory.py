"""glibc malloc settings for an engine on the CPU: keep freed activation memory for the next step.

Every step allocates and frees activations of many MB (a 2048-token prefill of the benchmark model
makes a 25 MB gate/up output). Above glibc's mmap threshold (128 KiB at first, adapting up to 32 MiB)
each such tensor is a fresh mmap whose pages fault in on first touch and are unmapped again when it
is freed, step after step. Raising the mmap and trim thresholds serves them from the heap instead,
pages already resident: +5% offline tokens/s on the benchmark model (`benchmarks/cpu_ablation.py`;
it was worth more before the fused kernels removed most temporaries). The cost is that up to
`HEAP_THRESHOLD_BYTES` of freed memory stays resident in the process.
"""

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

HEAP_THRESHOLD_BYTES = 1 << 30
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_TOP_PAD_BYTES = 64 << 20  # heap grown in steps this large, so growth is rare


def keep_freed_memory_resident() -> bool:
    """Apply the settings (process-wide); False where the C library has no `mallopt` (not glibc)."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        logger.info("no glibc mallopt here: CPU activations use the default allocator settings")
        return False
    settings = ((_M_MMAP_THRESHOLD, HEAP_THRESHOLD_BYTES), (_M_TRIM_THRESHOLD, HEAP_THRESHOLD_BYTES),
                (_M_TOP_PAD, _TOP_PAD_BYTES))  # fmt: skip
    return all(mallopt(option, value) == 1 for option, value in settings)
