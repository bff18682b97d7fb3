"""Why the delta encoding is what it is: candidate encodings measured on real BF16 updates.

    python benchmarks/bench_delta_codec.py [--rows 2048] [--cols 2048] [--steps 3]

One weight matrix (N(0, 0.02), as a transformers init) with FP32 master weights and a BF16 copy;
``torch.optim.AdamW`` steps it with random gradients at learning rates 1e-6, 1e-5 and 1e-4. For
the BF16 words that changed in the last step, prints the changed share, how far the words moved
(``|new - old|`` of the bit patterns read as integers, and how many bits their XOR spans), and the
bytes per changed element of each candidate:

- ``int32 idx + value``: vLLM's ``sparse_nccl`` and verl's ``delta_sharded`` (6 B);
- ``bitmask + value``: one bit per element plus the new value;
- ``uint16 gaps + value``: slime-style gaps (escape for longer ones) plus the new value;
- ``tokens + XOR codes``: our position tokens, the XOR of old and new in the narrowest code width;
- ``reshard``: ``delta_codec.encode`` (position tokens, difference codes), what refits send;
- ``reshard + zlib``: the same, then zlib level 1 (with its encode time against ours).

Encode and decode seconds per MiB of message are printed for ours. No assertions.
"""

from __future__ import annotations

import argparse
import time
import zlib

import torch

from reshard_core.execute import delta_codec


def _xor_code_bytes(xor: torch.Tensor) -> float:
    """Bytes for XOR values in the narrowest of 2/4/8/16-bit codes with whole-word escapes."""
    xor = xor.to(torch.int32) & 0xFFFF
    best = 2.0 * xor.numel()
    for bits in (2, 4, 8):
        escapes = int((xor >= (1 << bits) - 1).sum())
        best = min(best, xor.numel() * bits / 8 + 2 * escapes)
    return best


def _gap_bytes(positions: torch.Tensor, width: int) -> float:
    """Bytes of ``width``-byte gap tokens with skip escapes (as our position tokens are)."""
    skip = (1 << 8 * width) - 1
    gaps = torch.diff(positions, prepend=positions.new_tensor([-1])) - 1
    return width * float((gaps // skip + 1).sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--cols", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    print(f"one {args.rows}x{args.cols} BF16 matrix, AdamW, {args.steps} steps; last step's changes")
    head = (f"{'lr':>6} {'changed':>8} {'|d|=1':>6} {'|d|<=2':>7} {'xor>2b':>7} {'idx32':>6} {'mask':>6} "
            f"{'gap16':>6} {'xor':>6} {'ours':>6} {'+zlib':>6} {'zlib s/ours s':>13} {'enc MiB/s':>9} "
            f"{'dec MiB/s':>9}")  # fmt: skip
    print(head)
    for lr in (1e-6, 1e-5, 1e-4):
        gen = torch.Generator().manual_seed(0)
        master = (torch.randn(args.rows, args.cols, generator=gen) * 0.02).requires_grad_()
        opt = torch.optim.AdamW([master], lr=lr)
        copy = master.detach().to(torch.bfloat16)
        for _ in range(args.steps):
            old = copy.clone()
            master.grad = torch.randn(master.shape, generator=gen)
            opt.step()
            copy = master.detach().to(torch.bfloat16)
        cur16, old16 = copy.view(torch.int16).reshape(-1), old.view(torch.int16).reshape(-1)
        changed = cur16 != old16
        positions = changed.nonzero().squeeze(1)
        k, n = positions.numel(), cur16.numel()
        diff = (cur16[positions].to(torch.int32) - old16[positions].to(torch.int32)).abs()
        xor = (cur16[positions] ^ old16[positions]).to(torch.int32) & 0xFFFF
        start = time.perf_counter()
        payload = delta_codec.encode(cur16, old16, delta_codec.Scan(cur16, old16).changes())
        encode_s = time.perf_counter() - start
        start = time.perf_counter()
        delta = delta_codec.decode(payload)
        out = old16.clone()
        out[delta.positions] = delta.values(old16[delta.positions])
        decode_s = time.perf_counter() - start
        assert torch.equal(out, cur16)
        start = time.perf_counter()
        zipped = zlib.compress(payload.numpy().tobytes(), 1)
        zlib_s = time.perf_counter() - start
        tokens = min(_gap_bytes(positions, 1), _gap_bytes(positions, 2))
        per = {
            "idx32": 6.0,
            "mask": n / 8 / k + 2,
            "gap16": _gap_bytes(positions, 2) / k + 2,
            "xor": (tokens + _xor_code_bytes(xor)) / k,
            "ours": (payload.numel() - delta_codec.HEADER_BYTES) / k,
            "zlib": len(zipped) / k,
        }
        mib = cur16.nbytes / 2**20
        print(f"{lr:6.0e} {k / n:8.2%} {float((diff == 1).float().mean()):6.1%} "
              f"{float((diff <= 2).float().mean()):7.1%} {float((xor > 3).float().mean()):7.1%} "
              + " ".join(f"{per[c]:6.2f}" for c in ("idx32", "mask", "gap16", "xor", "ours", "zlib"))
              + f" {zlib_s / encode_s:13.1f} {mib / encode_s:9.0f} {mib / decode_s:9.0f}")  # fmt: skip


if __name__ == "__main__":
    main()
