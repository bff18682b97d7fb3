"""The wire encoding of a delta message: which 16-bit words of a message changed, and how.

A message is read as little-endian 16-bit words (a BF16 element is one word, an FP32 element two).
Against the sender's snapshot of what the receiver holds, a delta lists the changed words:

- **positions** as one token per changed word, of one byte or (for sparse messages, when that is
  smaller) two: token ``t < S`` puts the next changed word ``t + 1`` words after the previous one;
  ``t = S`` (255, or 65535) skips ``S`` words and names none. At density ``p`` byte tokens cost
  about ``1 + (1-p)^255`` bytes per changed word (1.08 at 1 %, 1.0 above 3 %);
- **values** as ``bits``-wide codes of the difference ``d = new - old`` of the word read as a signed
  integer, wrapped to 16 bits (``d != 0`` always). A small weight update moves a BF16 value by one or
  two units in the last place, which is ``d = ±1, ±2``: it needs 2 bits. Code ``z`` is the zigzag
  of ``d`` less one (``d = -1, 1, -2, 2, ...`` → ``0, 1, 2, 3, ...``); the top code ``2^bits - 1``
  is an escape whose word follows whole (its new value, not a difference). ``bits`` is 2, 4, 8 or
  16 (16: every new value whole, no codes), whichever gives the fewest bytes for this message.

Layout: a header of five int64 (changed words, tokens, token bytes × 256 + bits, escapes, the
message's word count), the tokens (2-byte tokens start at an even offset), the packed codes (little
end first within a byte), padding to an even offset, the escaped words as int16. Decoding gives the
positions and the changes; the receiver reads its old words there and writes the new ones: work and
memory proportional to the changed words, never to the message.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

HEADER_BYTES = 40
_WIDTHS = (2, 4, 8)


@dataclass(frozen=True)
class Delta:
    """A decoded delta: ``positions`` (int64, ascending word indices) and how each word changes:
    by ``diff`` (int32, added to the old word with 16-bit wrap-around), or to ``whole`` where
    ``escape`` is set (or everywhere when ``diff`` is None)."""

    positions: torch.Tensor
    diff: torch.Tensor | None
    escape: torch.Tensor | None
    whole: torch.Tensor | None

    def values(self, old: torch.Tensor, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """The new int16 words at ``positions[lo:hi]``, given the ``old`` int16 words there."""
        if self.diff is None:
            return self.whole[lo:hi]
        new = old + self.diff[lo:hi]  # int16 arithmetic wraps around, as the encoder's difference did
        if self.escape is not None:
            escape = self.escape[lo:hi]
            new[escape] = self.whole[lo:hi][escape]
        return new


def lower_bound(changed: int) -> int:
    """The fewest bytes a delta of ``changed`` words can take (a one-byte token and a 2-bit code
    each)."""
    return HEADER_BYTES + changed + -(-changed // 4)


@dataclass(frozen=True)
class Changes:
    """The words of a message that differ from a snapshot: ascending ``positions`` (int64) and the
    ``new`` and ``old`` int16 words there."""

    positions: torch.Tensor
    new: torch.Tensor
    old: torch.Tensor


class Scan:
    """Which 4-word (8-byte) blocks of ``cur`` differ from ``old`` (flat int16 tensors of one
    length): one compare and one count over a quarter as many elements as words, so that a message
    too dense for a delta is told before its changed words are listed. Single words when the
    tensors are not whole, aligned 8-byte blocks."""

    def __init__(self, cur: torch.Tensor, old: torch.Tensor) -> None:
        self.cur, self.old = cur, old
        whole = cur.numel() % 4 == 0 and cur.data_ptr() % 8 == 0 and old.data_ptr() % 8 == 0
        self.width = 4 if whole else 1
        kind = torch.int64 if whole else torch.int16
        self.mask = torch.ne(cur.view(kind), old.view(kind))
        self.blocks = int(torch.count_nonzero(self.mask))
        """Differing blocks: at least this many words changed, and at most ``width`` times as many."""

    def estimate(self) -> int:
        """The changed words, estimated from the differing blocks as if words changed independently."""
        if self.width == 1 or self.blocks == 0:
            return self.blocks
        share = self.blocks / self.mask.numel()
        return round(self.cur.numel() * (1 - (1 - share) ** 0.25)) if share < 1 else self.cur.numel()

    def changes(self) -> Changes:
        if self.width == 4 and self.blocks > self.mask.numel() // 4:  # dense: words directly are cheaper
            words = torch.ne(self.cur, self.old).nonzero().squeeze(1)
            return Changes(words, self.cur[words], self.old[words])
        blocks = self.mask.nonzero().squeeze(1)
        if self.width == 1:
            return Changes(blocks, self.cur[blocks], self.old[blocks])
        cur = self.cur.view(torch.int64)[blocks].view(torch.int16)  # the blocks' words, 4 each
        old = self.old.view(torch.int64)[blocks].view(torch.int16)
        inner = torch.ne(cur, old).nonzero().squeeze(1)
        return Changes(blocks[inner >> 2] * 4 + (inner & 3), cur[inner], old[inner])


def encode(cur: torch.Tensor, old: torch.Tensor, changes: Changes | None = None) -> torch.Tensor:
    """The delta turning ``old`` into ``cur`` (flat int16 tensors of one length) as a uint8 payload.
    ``changes``: ``Scan(cur, old).changes()`` when the caller has them already."""
    changes = Scan(cur, old).changes() if changes is None else changes
    positions, new = changes.positions, changes.new
    diff = torch.sub(new, changes.old).to(torch.int32)  # int16 arithmetic wraps around
    zig = ((diff << 1) ^ (diff >> 31)) - 1  # zigzag, less one: d = -1, 1, -2, 2, ... -> 0, 1, 2, 3, ...
    tokens = _tokens(positions)
    bits, codes, escaped = _values(zig, new)
    k = positions.numel()
    mode = tokens.element_size() * 256 + bits
    header = torch.tensor([k, tokens.numel(), mode, escaped.numel(), cur.numel()], dtype=torch.int64)
    parts = [header.to(cur.device).view(torch.uint8), tokens.view(torch.uint8), codes]
    if (HEADER_BYTES + tokens.nbytes + codes.numel()) % 2:
        parts.append(torch.zeros(1, dtype=torch.uint8, device=cur.device))
    parts.append(escaped.view(torch.uint8))
    return torch.cat(parts)


def decode(payload: torch.Tensor) -> Delta:
    """Decode ``payload`` (a uint8 tensor from ``encode``) into positions and value changes."""
    k, n_tokens, mode, n_escaped, _ = payload[:HEADER_BYTES].view(torch.int64).tolist()
    width, bits = divmod(mode, 256)
    at = HEADER_BYTES
    tokens = payload[at : at + width * n_tokens]
    tokens = tokens.view(torch.uint16).to(torch.int64) if width == 2 else tokens.to(torch.int64)
    at += width * n_tokens
    skip = (1 << 8 * width) - 1
    if n_tokens == k:  # no skips
        positions = (tokens + 1).cumsum(0) - 1
    else:
        steps = torch.where(tokens == skip, skip, tokens + 1)
        positions = (steps.cumsum(0) - 1)[tokens != skip]
    if bits == 16:
        at += at % 2
        return Delta(positions, None, None, payload[at : at + 2 * k].view(torch.int16))
    n_codes = -(-k * bits // 8)
    zig = _unpack(payload[at : at + n_codes], bits, k)
    at += n_codes
    at += at % 2
    escape = zig == (1 << bits) - 1
    whole = None
    if n_escaped:
        whole = torch.zeros(k, dtype=torch.int16, device=payload.device)
        whole[escape] = payload[at : at + 2 * n_escaped].view(torch.int16)
    zig = zig.to(torch.int16) + 1
    diff = (zig >> 1) ^ -(zig & 1)  # undo the zigzag
    return Delta(positions, diff, escape if n_escaped else None, whole)


def payload_words(payload: torch.Tensor) -> int:
    """The message length in words that ``payload`` was encoded against."""
    return int(payload[:HEADER_BYTES].view(torch.int64)[4])


def _tokens(positions: torch.Tensor) -> torch.Tensor:
    """Position tokens (see the module docstring) for ascending ``positions``: one byte each, or two
    where that is smaller (long gaps)."""
    if positions.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=positions.device)
    gaps = torch.diff(positions, prepend=positions.new_tensor([-1])) - 1
    if int(gaps.max()) < 255:  # dense enough: no skips (the common case, one pass)
        return gaps.to(torch.uint8)
    skips = {dtype: gaps // ((1 << 8 * dtype.itemsize) - 1) for dtype in (torch.uint8, torch.uint16)}
    dtype = min(skips, key=lambda d: d.itemsize * (gaps.numel() + int(skips[d].sum())))
    skip = (1 << 8 * dtype.itemsize) - 1
    counts = skips[dtype] + 1
    tokens = torch.full((int(counts.sum()),), skip, dtype=torch.int32, device=positions.device)
    tokens[counts.cumsum(0) - 1] = (gaps - skips[dtype] * skip).to(torch.int32)
    return tokens.to(dtype)


def _values(zig: torch.Tensor, new: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
    """The narrowest-in-bytes code width, the packed codes and the escaped whole words."""
    k = zig.numel()
    best = (2 * k, 16)
    for bits in _WIDTHS:
        size = -(-k * bits // 8) + 2 * int(torch.count_nonzero(zig >= (1 << bits) - 1))
        if size < best[0]:
            best = (size, bits)
    bits = best[1]
    if bits == 16:
        return 16, torch.empty(0, dtype=torch.uint8, device=zig.device), new
    top = (1 << bits) - 1
    escaped = new[zig >= top]
    return bits, _pack(zig.clamp(max=top).to(torch.uint8), bits), escaped


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 ``codes`` of ``bits`` each, packed little end first into bytes."""
    per = 8 // bits
    k = codes.numel()
    padded = torch.zeros(-(-k // per) * per, dtype=torch.uint8, device=codes.device)
    padded[:k] = codes
    columns = padded.view(-1, per)
    out = columns[:, 0].clone()
    for j in range(1, per):
        out |= columns[:, j] << (j * bits)
    return out


def _unpack(packed: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    per = 8 // bits
    shifts = torch.arange(per, dtype=torch.int32, device=packed.device) * bits
    codes = (packed.to(torch.int32).unsqueeze(1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(-1)[:k]
