"""Block-quantized payloads: a tensor sent as bf16, fp16, int8 or int4 codes with one
absmax scale per block, plus a weight, in one uint8 buffer (DiLoCo's exchanged
pseudo-gradients, parallel/diloco.py).

- bf16 / fp16: a cast, rounding to nearest (relative error at most 2^-8 / 2^-11).
- int8 / int4: symmetric codes in [-127, 127] / [-7, 7]. Each block of `block` elements
  carries an fp32 scale, its absmax / levels, so the absmax maps to the top code and every
  value is within half a step (absmax / (2 x levels)) of its decoded value. int4 packs two codes a byte, each
  stored as code + 8.
- The layout is weight (fp64), scales, codes, zero-padded to a multiple of 8 bytes. So
  payloads gathered side by side each start aligned, and one collective carries all.
"""

from __future__ import annotations

import torch

_CAST = {"bf16": torch.bfloat16, "fp16": torch.float16}
_LEVELS = {"int8": 127, "int4": 7}  # symmetric codes in [-levels, levels]


def payload_bytes(numel: int, fmt: str, block: int) -> int:
    """Bytes of the payload `encode` makes of `numel` elements."""
    if fmt in _CAST:
        body = 2 * numel
    else:
        blocks = -(-numel // block)
        body = 4 * blocks + (blocks * block if fmt == "int8" else blocks * block // 2)
    return 8 + -(-body // 8) * 8


def encode(x: torch.Tensor, *, fmt: str, block: int, weight: float) -> torch.Tensor:
    """`x` as one uint8 payload: `weight` (fp64), then (int8, int4) one fp32
    absmax scale per `block` elements, then `x` (1-D) coded in `fmt`; zero-padded to a
    multiple of 8 bytes, so every island's payload in a gathered buffer starts aligned."""
    parts = [torch.tensor([weight], dtype=torch.float64, device=x.device).view(torch.uint8)]
    if fmt in _CAST:
        parts.append(x.to(_CAST[fmt]).view(torch.uint8))
    else:
        levels = _LEVELS[fmt]
        padded = x.new_zeros(-(-x.numel() // block) * block, dtype=torch.float32)
        padded[: x.numel()] = x
        blocks = padded.view(-1, block)  # (n_blocks, block)
        scale = blocks.abs().amax(dim=1) / levels  # (n_blocks,)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # all-zero block: codes 0
        codes = torch.round(blocks / safe[:, None]).clamp_(-levels, levels).to(torch.int8)
        if fmt == "int8":
            packed = codes.view(torch.uint8).reshape(-1)
        else:  # two codes a byte, each as code + 8 in [1, 15]
            nibbles = (codes.reshape(-1) + 8).to(torch.uint8)
            packed = nibbles[0::2] | (nibbles[1::2] << 4)
        parts += [scale.view(torch.uint8), packed]
    payload = torch.cat(parts)
    pad = payload_bytes(x.numel(), fmt, block) - payload.numel()
    return torch.cat([payload, payload.new_zeros(pad)]) if pad else payload


def decode(
    payload: torch.Tensor, *, fmt: str, block: int, numel: int, dtype: torch.dtype
) -> tuple[torch.Tensor, float]:
    """(the tensor in `dtype`, the weight) from `encode`'s payload."""
    weight = float(payload[:8].view(torch.float64))
    if fmt in _CAST:
        return payload[8 : 8 + 2 * numel].view(_CAST[fmt]).to(dtype), weight
    blocks = -(-numel // block)
    scale = payload[8 : 8 + 4 * blocks].view(torch.float32)
    packed = payload[8 + 4 * blocks :]
    if fmt == "int8":
        codes = packed[: blocks * block].view(torch.int8)
    else:
        packed = packed[: blocks * block // 2]
        codes = torch.stack([packed & 0xF, packed >> 4], dim=1).reshape(-1).to(torch.int8) - 8
    values = codes.view(-1, block).to(torch.float32) * scale[:, None]
    return values.reshape(-1)[:numel].to(dtype), weight
