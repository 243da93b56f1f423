"""The linear layers of the benchmark model on a CPU: `F.linear` (MKL's sgemm in float32), oneDNN on
the plain weight, oneDNN on a weight packed into its blocked layout (kvserve's path), and the MLP
block eager (packed weights + the C++ SiLU-and-mul) against torch.compile of it.

    .venv/bin/python -m benchmarks.cpu_gemm

Times are medians of 30 calls after 5 warm-up calls, in microseconds, with torch's default threads.
"""

import argparse
import time
from functools import partial

import torch
import torch.nn.functional as F

from benchmarks.harness import median_ms
from kvserve.kernels import onednn as kvserve_onednn
from kvserve.kernels.cpu_extension import load_cpu_kernels

HIDDEN, INTERMEDIATE, VOCAB = 512, 1536, 16384
SHAPES = {  # name: (in, out) of the benchmark model's projections
    "qkv 512->768": (HIDDEN, 768), "gate_up 512->3072": (HIDDEN, 2 * INTERMEDIATE),
    "down 1536->512": (INTERMEDIATE, HIDDEN), "lm_head 512->16384": (HIDDEN, VOCAB),
}  # fmt: skip
ROWS = (33, 64, 2048)  # a decode batch, a full one, a prefill step


def median_us(fn, x: torch.Tensor) -> float:
    """Median microseconds of 30 calls of fn(x), after 5 warm-up calls."""
    return median_ms(fn, x, repeats=30, warmup=5) * 1e3


def onednn(input, weight):
    return kvserve_onednn.packed_linear(input, weight)


def gemm_table(dtype: torch.dtype) -> None:
    print(f"\n{dtype}: F.linear / oneDNN plain weight / oneDNN packed weight, us")
    for name, (size_in, size_out) in SHAPES.items():
        weight = torch.randn(size_out, size_in, dtype=dtype) * 0.05
        packed = kvserve_onednn.pack(weight)
        peers = (partial(F.linear, weight=weight), partial(onednn, weight=weight), partial(onednn, weight=packed))
        for rows in ROWS:
            x = torch.randn(rows, size_in, dtype=dtype)
            times = [median_us(peer, x) for peer in peers]
            print(f"  {name:20} {rows:5d} rows: {times[0]:9.1f} {times[1]:9.1f} {times[2]:9.1f}"
                  f"   F.linear/packed {times[0] / times[2]:.2f}x")  # fmt: skip


def mlp_table() -> None:
    import torch._inductor.config

    gate_up = torch.randn(2 * INTERMEDIATE, HIDDEN) * 0.05
    down = torch.randn(HIDDEN, INTERMEDIATE) * 0.05
    packed_gate_up = kvserve_onednn.pack(gate_up)
    packed_down = kvserve_onednn.pack(down)

    def kvserve_mlp(x):
        activated = torch.empty(x.shape[0], INTERMEDIATE)
        torch.ops.kvserve_cpu.silu_and_mul(activated, onednn(x, packed_gate_up))
        return onednn(activated, packed_down)

    class MLP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_up = torch.nn.Linear(HIDDEN, 2 * INTERMEDIATE, bias=False)
            self.down = torch.nn.Linear(INTERMEDIATE, HIDDEN, bias=False)
            self.gate_up.weight.data.copy_(gate_up)
            self.down.weight.data.copy_(down)

        def forward(self, x):
            gate, up = self.gate_up(x).chunk(2, dim=-1)
            return self.down(F.silu(gate) * up)

    torch._inductor.config.freezing = True  # constant weights: inductor packs them, as kvserve does
    module = MLP().eval()
    start_s = time.perf_counter()
    compiled = torch.compile(module, dynamic=True)
    compiled(torch.randn(64, HIDDEN))
    compiled(torch.randn(100, HIDDEN))
    print(f"\nMLP block (512 -> 2x1536 -> 512, fp32), us; torch.compile took {time.perf_counter() - start_s:.0f} s")
    print("  rows: eager F.linear + F.silu / kvserve (packed + C++ SiLU-and-mul) / torch.compile")
    for rows in ROWS:
        x = torch.randn(rows, HIDDEN)
        times = [median_us(peer, x) for peer in (module, kvserve_mlp, compiled)]
        print(f"  {rows:5d}: {times[0]:9.1f} {times[1]:9.1f} {times[2]:9.1f}")


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # no options but --help
    if not load_cpu_kernels():
        raise SystemExit("the C++ CPU kernels could not be built (see the log)")
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    with torch.inference_mode():
        gemm_table(torch.float32)
        gemm_table(torch.bfloat16)
    with torch.no_grad():
        mlp_table()


if __name__ == "__main__":
    main()
