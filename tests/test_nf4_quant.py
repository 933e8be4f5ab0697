"""NF4 with double quantisation and int8: the same bytes and values as bitsandbytes (its CPU backend).

bitsandbytes is a test-only dependency; its CPU quantisers are the oracle for every byte we store:
the packed 4-bit codes, the 8-bit block absmax codes, their fp32 scales and offset, and the
dequantised values, for weights of odd sizes and for TP shards quantised on their own.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from tpkernels.quant import (
    ABSMAX_BLOCK,
    BLOCK,
    DYNAMIC_MAP,
    NF4_CODE,
    NF4Weight,
    dequantize_absmax,
    dequantize_int8,
    dequantize_nf4,
    nf4_bytes_per_param,
    quantize_int8,
    quantize_nf4,
)

bnbF = pytest.importorskip("bitsandbytes.functional")

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@contextlib.contextmanager
def _eager():
    """bitsandbytes torch.compiles its odd-shape dequantisation: run it eagerly (same math, seconds less)."""
    with torch._dynamo.config.patch(disable=True):
        yield


def _bnb(w: torch.Tensor):
    with _eager():
        packed, state = bnbF.quantize_4bit(w, blocksize=BLOCK, quant_type="nf4", compress_statistics=True)
        return packed, state, bnbF.dequantize_4bit(packed, state)


def _assert_same_as_bnb(w: torch.Tensor) -> NF4Weight:
    q = quantize_nf4(w)
    packed, state, deq = _bnb(w)
    assert torch.equal(q.packed, packed.reshape(-1)), "packed 4-bit codes differ"
    assert torch.equal(q.absmax_q, state.absmax), "8-bit absmax codes differ"
    assert torch.equal(q.absmax_scale, state.state2.absmax), "absmax scales differ"
    assert torch.equal(q.absmax_offset, state.offset), "absmax offset differs"
    ours = dequantize_nf4(q)
    assert ours.dtype == w.dtype and ours.shape == w.shape
    assert torch.equal(ours, deq), f"dequantised values differ: max {(ours.float() - deq.float()).abs().max()}"
    return q


def test_codebooks_are_bitsandbytes():
    assert torch.equal(DYNAMIC_MAP, bnbF.create_dynamic_map())
    assert torch.equal(torch.tensor(NF4_CODE), bnbF.get_4bit_type("nf4", device="cpu"))


@pytest.mark.parametrize("shape", [(17, 130), (1, 64), (129, 65), (3,), (1, 1), (64, 256 * BLOCK + 3)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_bytes_and_values_equal_bitsandbytes(shape, dtype):
    torch.manual_seed(hash((shape, str(dtype))) % 2**31)
    w = (0.02 * torch.randn(shape)).to(dtype)
    w.view(-1)[:: max(1, w.numel() // 7)] *= 40  # outliers: blocks of very different absmax
    _assert_same_as_bnb(w)


@pytest.mark.parametrize("tp", [2, 3])
@pytest.mark.parametrize("dim", [0, 1])
def test_tp_shards_quantised_alone_equal_bitsandbytes(tp, dim):
    """Each rank quantises its own (out/tp, in) or (out, in/tp) slice as a tensor of its own; shards whose
    numel is not a multiple of 64 end in a short block, exactly as bitsandbytes does for that shard."""
    torch.manual_seed(tp * 10 + dim)
    w = 0.02 * torch.randn(96, 200, dtype=torch.bfloat16)
    shards = torch.tensor_split(w, tp, dim=dim)
    short = [s.numel() % BLOCK for s in shards]
    if (tp, dim) == (3, 1):
        assert short == [32, 32, 0], short  # (96, 67 | 67 | 66): 6432 = 100.5 blocks, 6336 = 99
    for shard in shards:
        q = _assert_same_as_bnb(shard)
        assert q.shape == tuple(shard.shape) and q.absmax_q.numel() == math.ceil(shard.numel() / BLOCK)


def test_double_quantisation_round_trip():
    torch.manual_seed(0)
    w = 0.02 * torch.randn(300, 301) * (1 + 10 * torch.rand(300, 1))  # absmax spread over a decade
    q = quantize_nf4(w)
    n = w.numel()
    blocks = torch.nn.functional.pad(w.reshape(-1), (0, -n % BLOCK)).view(-1, BLOCK)
    true_absmax = blocks.abs().amax(1)
    assert torch.equal(q.absmax_offset, true_absmax.mean())
    got = dequantize_absmax(q)
    # the centred absmax sit in the top decade of the dynamic map (spacing 0.9/64) of their group's scale,
    # or below it with finer spacing: half a spacing, plus the 65536-bin grid of the CPU quantiser
    bound = q.absmax_scale.repeat_interleave(ABSMAX_BLOCK)[: got.numel()] * (0.9 / 128 + 2 / 65535) + 1e-7
    assert ((got - true_absmax).abs() <= bound).all()
    # the weights: |level·got − t·absmax| ≤ |got − absmax| + half the widest NF4 gap (−1 to −0.696) · absmax
    deq = dequantize_nf4(q, torch.float32).reshape(-1)
    err = torch.nn.functional.pad((deq - w.reshape(-1)).abs(), (0, -n % BLOCK)).view(-1, BLOCK).amax(1)
    gap = max(b - a for a, b in zip(NF4_CODE, NF4_CODE[1:]))
    assert (err <= true_absmax * gap / 2 + (got - true_absmax).abs() + 1e-7).all()
    # a zero block and an all-zero weight: exact zeros back
    z = torch.zeros(2, 96)
    z[1, 5] = 3.0
    assert torch.equal(dequantize_nf4(quantize_nf4(z))[0], torch.zeros(96))
    _assert_same_as_bnb(z)
    assert torch.equal(dequantize_nf4(quantize_nf4(torch.zeros(5, 7))), torch.zeros(5, 7))


def test_memory_per_parameter():
    assert nf4_bytes_per_param() == pytest.approx(0.5 + 1 / 64 + 4 / (64 * 256))
    assert 0.515 < nf4_bytes_per_param() < 0.52
    q = quantize_nf4(torch.randn(1024, 1024))
    assert q.nbytes == pytest.approx(nf4_bytes_per_param(q.numel) * q.numel)
    assert q.nbytes / q.numel < 0.52
    assert nf4_bytes_per_param(17 * 130) > nf4_bytes_per_param()  # short blocks and the offset cost more


def test_int8_per_channel():
    torch.manual_seed(0)
    w = 0.02 * torch.randn(33, 130)
    w[3] = 0.0
    q = quantize_int8(w)
    assert q.data.dtype == torch.int8 and q.absmax.shape == (33,)
    with _eager():
        codes, stats, _ = bnbF.int8_vectorwise_quant(w.clone())
    assert torch.equal(q.data[torch.arange(33) != 3], codes[torch.arange(33) != 3])  # bitsandbytes' codes
    assert torch.equal(q.data[3], torch.zeros(130, dtype=torch.int8))
    d = dequantize_int8(q)
    assert d.dtype == w.dtype
    assert ((d - w).abs() <= q.absmax[:, None] / 254 + 1e-7).all()
    assert dequantize_int8(q, torch.bfloat16).dtype == torch.bfloat16
    assert q.nbytes == 33 * 130 + 33 * 4


def test_bad_inputs_are_named():
    with pytest.raises(TypeError, match="dtype"):
        quantize_nf4(torch.ones(4, 64, dtype=torch.int32))
    w64 = torch.randn(4, 65, dtype=torch.float64)  # float64 (oracle runs): quantised from its float32 rounding
    q64, q32 = quantize_nf4(w64), quantize_nf4(w64.float())
    assert torch.equal(q64.packed, q32.packed) and torch.equal(q64.absmax_q, q32.absmax_q)
    assert dequantize_nf4(q64).dtype == torch.float64
    with pytest.raises(ValueError, match="NaN or infinite"):
        quantize_nf4(torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="at least one element"):
        quantize_nf4(torch.ones(0, 4))
    with pytest.raises(TypeError, match="NF4Weight"):
        dequantize_nf4(torch.ones(4))
    with pytest.raises(ValueError, match=r"\(out_features, in_features\)"):
        quantize_int8(torch.ones(4))
    with pytest.raises(TypeError, match="Int8Weight"):
        dequantize_int8(quantize_nf4(torch.ones(2, 2)))
