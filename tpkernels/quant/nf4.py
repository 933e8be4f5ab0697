"""NF4 (4-bit NormalFloat) with double quantisation, as QLoRA and bitsandbytes define it, and int8.

NF4 (QLoRA, Dettmers et al. 2023, arXiv:2305.14314, §3):
  * a weight is flattened row-major and cut into blocks of ``BLOCK`` = 64 values; each block keeps
    its absolute maximum ``absmax`` (fp32) and each value becomes the 4-bit index of the nearest of
    the 16 NormalFloat levels ``NF4_CODE`` (quantiles of N(0, 1) scaled to [-1, 1], with an exact 0)
    to ``value / absmax``;
  * two indices per byte: the value at the even flat index in the high nibble, the odd one in the
    low nibble (an odd element count pads one 0.0, index 7);
  * double quantisation: the fp32 block absmax are themselves stored in 8 bits. Their mean
    (``absmax_offset``) is subtracted, and the centred values are quantised blockwise by 256
    (``ABSMAX_BLOCK``) with bitsandbytes' signed dynamic 8-bit map (``DYNAMIC_MAP``: 7 decades of
    exponent, a linear fraction within each), keeping one fp32 ``absmax_scale`` per 256 blocks.

Memory per parameter: 4 bits + 8 bits per 64 + 32 bits per 64·256, i.e.
0.5 + 1/64 + 1/4096 ≈ 0.5159 bytes (plus 4 bytes per tensor), against 2 for bf16
(:func:`nf4_bytes_per_param`). Without double quantisation it would be 0.5 + 4/64 = 0.5625.

Equality with bitsandbytes (0.50, ``quantize_4bit(w, blocksize=64, quant_type="nf4",
compress_statistics=True)`` and ``dequantize_4bit`` on its CPU backend): the same bytes (packed
codes, 8-bit absmax codes, absmax scales and offset) and the same dequantised values, bit for bit,
for fp32 / fp16 / bf16 weights of any shape (tests/test_nf4_quant.py). The rules that make it so:
  * 4-bit step: the weights are upcast to fp32; a full block's values are multiplied by the fp32
    reciprocal of its absmax, the short last block's (when numel % 64 ≠ 0) are divided by its
    absmax (that absmax is clamped to ≥ 1e-38, a full block's is not); the result is clamped to
    [-1, 1] and mapped to the first level whose upper midpoint (fp32 (c[i] + c[i+1]) / 2) it does
    not exceed: a tie goes to the lower level.
  * 8-bit absmax step: bitsandbytes' CPU quantiser does not search the map. Per 256 block it
    takes v = clamp(x · (1 / absmax), -1, 1) in fp32, the bin t = trunc(((v + 1) · 0.5) · 65535 +
    0.5) of a 65536-bin grid of [-1, 1], and a table that gives for each grid point g_t = -1 +
    2t / 65535 the first map level whose fp32 midpoint with its upper neighbour is not below g_t.
    This is the nearest level up to the grid's 3·10⁻⁵ resolution (levels nearer than that to each
    other, near 0, can round to a neighbour); we build the same table. A block whose absmax is 0
    stores codes 0. (bitsandbytes' CUDA kernel searches the map exactly, so on rare values its
    absmax codes differ from its CPU backend's; the dequantised absmax then differ by one level.)
  * dequantisation: fp32 ``level · absmax`` (one rounding), cast to the target dtype (round to
    nearest even); the absmax as fp32 ``map[q] · absmax_scale`` then ``+ offset`` (two roundings).
  * the offset is ``absmax.mean()`` in fp32 on the weight's device (a reduction: on a GPU its last
    bit may differ from the CPU's, and with it some absmax codes).

Tensor parallelism: a rank quantises only its own shard, as a tensor of its own: the row-major
flatten of its (out/tp, in) or (out, in/tp) slice, so a block never straddles a TP split. A shard
whose numel is not a multiple of 64 ends with a short block (its absmax is over the remaining
values), exactly as bitsandbytes quantises that shard alone; the shards' codes therefore differ
from slices of the full weight's codes, and every rank must re-quantise from the full-precision
checkpoint slice (never slice a quantised weight).

int8 (LLM.int8's vector-wise absmax, without outliers): per output channel (row) absmax,
q = round(w · 127 / absmax) in fp32, int8 (out, in); w ≈ q · absmax / 127.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

BLOCK = 64  # values per absmax block (QLoRA's and bitsandbytes' default for NF4)
ABSMAX_BLOCK = 256  # block absmax per fp32 scale in the double quantisation (bitsandbytes' choice)

# The 16 NF4 levels: quantiles of N(0, 1) normalised to [-1, 1], 8 positive and 7 negative so that
# 0 is exact (QLoRA eq. 4, offset 0.9677), as fp32 (bitsandbytes' table, to the last bit).
NF4_CODE = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
            -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
            0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
            0.7229568362236023, 1.0)

_LUT_BINS = 65536  # bitsandbytes' CPU 8-bit quantiser grid on [-1, 1] (see the module docstring)
_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _build_dynamic_map() -> Tensor:
    """The signed dynamic 8-bit map (Dettmers 2015, arXiv:1511.04561) with 7 exponent bits, as
    bitsandbytes' ``create_dynamic_map()``: for decade e = 0..6, the 2^e midpoints of an fp32 grid of
    2^e + 1 points on [0.1, 1], times 10^(e − 6), with both signs; then 0 and 1. 256 sorted fp32."""
    levels = [0.0, 1.0]
    for e in range(7):
        grid = torch.linspace(0.1, 1, 2 ** e + 1, dtype=torch.float32)
        mids = (grid[:-1] + grid[1:]) / 2.0
        scaled = (10 ** (e - 6)) * mids  # fp32 product, as bitsandbytes computes it
        levels += scaled.tolist() + (-scaled).tolist()
    assert len(levels) == 256
    return torch.tensor(sorted(levels), dtype=torch.float32)


DYNAMIC_MAP = _build_dynamic_map()  # (256,) fp32, CPU; dynamic_map(device) for other devices


@functools.lru_cache(maxsize=None)
def dynamic_map(device: torch.device | str = "cpu") -> Tensor:
    return DYNAMIC_MAP.to(device)


@functools.lru_cache(maxsize=None)
def nf4_code(device: torch.device | str = "cpu") -> Tensor:
    return torch.tensor(NF4_CODE, dtype=torch.float32, device=device)


@functools.lru_cache(maxsize=None)
def _nf4_midpoints(device: torch.device | str) -> Tensor:
    code = nf4_code(device)
    return (code[:-1] + code[1:]) / 2


@functools.lru_cache(maxsize=None)
def _dynamic_lut(device: torch.device | str) -> Tensor:
    """(65536,) int64: grid bin -> dynamic-map level (bitsandbytes' CPU quantiser table)."""
    code = dynamic_map(device)
    mids = 0.5 * (code[:-1] + code[1:])
    grid = -1.0 + (2.0 * torch.arange(_LUT_BINS, dtype=torch.float32, device=device)) / float(_LUT_BINS - 1)
    return torch.searchsorted(mids, grid)  # number of midpoints strictly below each grid point


@dataclass(frozen=True)
class NF4Weight:
    """A weight in NF4 with double quantisation (see the module docstring for every layout).

    packed:        (ceil(numel / 2),) uint8, two 4-bit NF4 indices per byte, even flat index high.
    absmax_q:      (ceil(numel / 64),) uint8, each block's absmax minus the offset, as an index
                   into ``DYNAMIC_MAP``, scaled by its group's ``absmax_scale``.
    absmax_scale:  (ceil(blocks / 256),) fp32, the absmax of each group of 256 centred block absmax.
    absmax_offset: () fp32, the mean of the fp32 block absmax.
    shape, dtype:  the original weight's (dequantize_nf4 returns that dtype by default).
    """

    packed: Tensor
    absmax_q: Tensor
    absmax_scale: Tensor
    absmax_offset: Tensor
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in
                   (self.packed, self.absmax_q, self.absmax_scale, self.absmax_offset))

    def to(self, device: torch.device | str) -> NF4Weight:
        return NF4Weight(self.packed.to(device), self.absmax_q.to(device), self.absmax_scale.to(device),
                         self.absmax_offset.to(device), self.shape, self.dtype)


@dataclass(frozen=True)
class Int8Weight:
    """data (out, in) int8; absmax (out,) fp32, each row's absmax: w ≈ data · absmax / 127."""

    data: Tensor
    absmax: Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def nbytes(self) -> int:
        return self.data.numel() + self.absmax.numel() * 4


def nf4_bytes_per_param(numel: int | None = None) -> float:
    """Bytes per parameter of an NF4 weight with double quantisation: 0.5 (codes) + 1/64 (8-bit
    absmax) + 4/(64·256) (fp32 absmax scales) ≈ 0.5159; with ``numel``, exact for that tensor
    (rounding up the blocks, plus the 4-byte offset)."""
    if numel is None:
        return 0.5 + 1 / BLOCK + 4 / (BLOCK * ABSMAX_BLOCK)
    blocks = -(-numel // BLOCK)
    return ((numel + 1) // 2 + blocks + 4 * -(-blocks // ABSMAX_BLOCK) + 4) / numel


def _check_weight(w: Tensor, name: str = "w") -> None:
    if not isinstance(w, Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(w).__name__}")
    if w.dtype not in _FLOATS:
        raise TypeError(f"{name} dtype ({w.dtype}) must be float32, float16, bfloat16 or float64 (float64 is "
                        "quantised from its float32 rounding)")
    if w.numel() == 0:
        raise ValueError(f"{name} must have at least one element, got shape {tuple(w.shape)}")
    if not bool(torch.isfinite(w).all()):
        raise ValueError(f"{name} holds NaN or infinite values: they have no NF4 / int8 code")


def _quantize_dynamic8(x: Tensor) -> tuple[Tensor, Tensor]:
    """Blockwise (256) 8-bit quantisation of fp32 ``x`` with the dynamic map, bitsandbytes' CPU rule
    -> (codes (n,) uint8, absmax (ceil(n / 256),) fp32)."""
    n = x.numel()
    groups = -(-n // ABSMAX_BLOCK)
    padded = torch.nn.functional.pad(x, (0, groups * ABSMAX_BLOCK - n)).view(groups, ABSMAX_BLOCK)
    absmax = padded.abs().amax(1)
    zero = absmax == 0
    inv = torch.where(zero, 0.0, 1.0 / absmax).repeat_interleave(ABSMAX_BLOCK)[:n]  # no inf · 0
    v = (x * inv).clamp(-1.0, 1.0)
    t = ((v + 1.0) * 0.5) * float(_LUT_BINS - 1) + 0.5  # fp32 at each step, as bitsandbytes rounds it
    codes = _dynamic_lut(x.device)[t.to(torch.int64)]
    return torch.where(zero.repeat_interleave(ABSMAX_BLOCK)[:n], 0, codes).to(torch.uint8), absmax


def quantize_nf4(w: Tensor) -> NF4Weight:
    """w (any shape, float32 / float16 / bfloat16, finite) -> NF4Weight of its row-major flatten,
    on w's device. Quantise a TP shard as a tensor of its own (module docstring)."""
    _check_weight(w)
    a = w.detach().reshape(-1).float()
    n = a.numel()
    full = n - n % BLOCK
    parts, scaled = [], []
    if full:
        blocks = a[:full].view(-1, BLOCK)
        am = blocks.abs().amax(1)
        parts.append(am)
        scaled.append((blocks * (1.0 / am.clamp(min=1e-38))[:, None]).clamp(-1, 1).reshape(-1))
    if n > full:  # the short last block: bitsandbytes divides here, and keeps the clamped absmax
        am = a[full:].abs().max().clamp(min=1e-38)
        parts.append(am.reshape(1))
        scaled.append((a[full:] / am).clamp(-1, 1))
    absmax = torch.cat(parts)
    s = torch.cat(scaled)
    if n % 2:
        s = torch.nn.functional.pad(s, (0, 1))  # 0.0 -> level 7
    q = torch.bucketize(s, _nf4_midpoints(a.device)).to(torch.uint8)
    packed = (q[0::2] << 4) | q[1::2]
    offset = absmax.mean()
    absmax_q, absmax_scale = _quantize_dynamic8(absmax - offset)
    return NF4Weight(packed, absmax_q, absmax_scale, offset, tuple(w.shape), w.dtype)


def dequantize_absmax(q: NF4Weight) -> Tensor:
    """The fp32 block absmax (ceil(numel / 64),) of ``q``: map[absmax_q] · absmax_scale + offset."""
    scale = q.absmax_scale.repeat_interleave(ABSMAX_BLOCK)[:q.absmax_q.numel()]
    return dynamic_map(q.device)[q.absmax_q.long()] * scale + q.absmax_offset


def unpack_codes(q: NF4Weight) -> Tensor:
    """(numel,) int64 NF4 level indices of ``q`` in flat order."""
    codes = torch.stack(((q.packed >> 4), (q.packed & 0xF)), dim=1).reshape(-1)
    return codes[:q.numel].long()


def dequantize_nf4(q: NF4Weight, dtype: torch.dtype | None = None) -> Tensor:
    """The weight ``q`` holds, in ``dtype`` (default: the quantised weight's), shape ``q.shape``.
    Values: fp32 NF4 level · block absmax, rounded once to ``dtype``."""
    if not isinstance(q, NF4Weight):
        raise TypeError(f"q must be an NF4Weight (from quantize_nf4), got {type(q).__name__}")
    absmax = dequantize_absmax(q).repeat_interleave(BLOCK)[:q.numel]
    w = nf4_code(q.device)[unpack_codes(q)] * absmax
    return w.to(dtype or q.dtype).reshape(q.shape)


def quantize_int8(w: Tensor) -> Int8Weight:
    """w (out, in) float -> Int8Weight: per output channel absmax, q = round(w · (127 / absmax)) in fp32
    (the codes of bitsandbytes' ``int8_vectorwise_quant`` without outliers); an all-zero row stores 0s."""
    _check_weight(w)
    if w.dim() != 2:
        raise ValueError(f"w must be (out_features, in_features), got shape {tuple(w.shape)}")
    a = w.detach().float()
    absmax = a.abs().amax(1)
    q = torch.round(a * (127.0 / absmax.clamp(min=1e-38)).unsqueeze(1)).clamp(-127, 127).to(torch.int8)
    return Int8Weight(q, absmax, w.dtype)


def dequantize_int8(q: Int8Weight, dtype: torch.dtype | None = None) -> Tensor:
    """(out, in) in ``dtype`` (default: the quantised weight's): q · (absmax / 127), fp32 then cast."""
    if not isinstance(q, Int8Weight):
        raise TypeError(f"q must be an Int8Weight (from quantize_int8), got {type(q).__name__}")
    return (q.data.float() * (q.absmax / 127.0).unsqueeze(1)).to(dtype or q.dtype)


__all__ = ["ABSMAX_BLOCK", "BLOCK", "DYNAMIC_MAP", "NF4_CODE", "Int8Weight", "NF4Weight", "dequantize_absmax",
           "dequantize_int8", "dequantize_nf4", "dynamic_map", "nf4_bytes_per_param", "nf4_code", "quantize_int8",
           "quantize_nf4", "unpack_codes"]
