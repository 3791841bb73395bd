"""The SpeCache quantiser against hand-computed groups: b = 1 (levels at the midpoints of the lower and upper
halves of the range) and b = 2 (KIVI), K per channel over groups of tokens, V per token over groups of channels."""

import pytest
import torch

from chunkcache.specache import quant

# one group of four values per row, and what each bit width makes of it (all exact in float16)
#            values                   zero  scale  codes          dequantised
B1 = [([0.0, 1.5, 2.5, 4.0], 1.0, 2.0, [0, 0, 1, 1], [1.0, 1.0, 3.0, 3.0]),  # zero (3*0+4)/4, scale (4-0)/2
      ([-2.0, -1.0, 5.0, 6.0], 0.0, 4.0, [0, 0, 1, 1], [0.0, 0.0, 4.0, 4.0])]  # zero (3*-2+6)/4, scale 8/2
B2 = [([0.0, 0.9, 2.2, 3.0], 0.0, 1.0, [0, 1, 2, 3], [0.0, 1.0, 2.0, 3.0]),  # zero min, scale (max-min)/3
      ([10.0, 15.0, 13.0, 22.0], 10.0, 4.0, [0, 1, 1, 3], [10.0, 14.0, 14.0, 22.0])]


@pytest.mark.parametrize("bits,table", [(1, B1), (2, B2)])
def test_levels_by_hand(bits, table):
    x = torch.tensor([row[0] for row in table])
    codes, scale, zero = quant.quantize(x, bits, dim=1)
    assert scale.dtype == zero.dtype == quant.PARAM_DTYPE
    assert zero.flatten().tolist() == [row[1] for row in table]
    assert scale.flatten().tolist() == [row[2] for row in table]
    assert codes.tolist() == [row[3] for row in table]
    assert quant.dequantize(codes, scale, zero).tolist() == [row[4] for row in table]


@pytest.mark.parametrize("bits,table", [(1, B1), (2, B2)])
def test_keys_per_channel_over_tokens(bits, table):
    """Each table row is one key channel over a group of 4 tokens; channels 2..7 copy channels 0 and 1."""
    T, D = 4, 8
    k = torch.tensor([row[0] for row in table]).T.repeat(1, D // 2)[:, None]  # [T, 1, D]
    packed, scale, zero = quant.quantize_keys(k, bits, group=T)
    assert packed.shape == (T, 1, D * bits // 8) and packed.dtype == torch.uint8
    assert scale.shape == zero.shape == (1, 1, D)
    assert scale[0, 0, :2].tolist() == [row[2] for row in table]
    assert zero[0, 0, :2].tolist() == [row[1] for row in table]
    deq = quant.dequantize_keys(packed, scale.expand(T, 1, D), zero.expand(T, 1, D), bits)
    assert deq[:, 0, :2].T.tolist() == [row[4] for row in table]


@pytest.mark.parametrize("bits,table", [(1, B1), (2, B2)])
def test_values_per_token_over_channels(bits, table):
    """One token whose 8 channels are the two table rows side by side: two groups of 4 channels."""
    v = torch.tensor([sum((row[0] for row in table), [])])[:, None]  # [1, 1, 8]
    packed, scale, zero = quant.quantize_values(v, bits, group=4)
    assert scale.shape == zero.shape == (1, 1, 2)
    assert scale.flatten().tolist() == [row[2] for row in table]
    assert zero.flatten().tolist() == [row[1] for row in table]
    assert quant.dequantize_values(packed, scale, zero, bits).flatten().tolist() == sum((row[4] for row in table), [])


def test_constant_group_is_exact():
    codes, scale, zero = quant.quantize(torch.full((1, 4), 2.5), 1, dim=1)
    assert scale.item() == 0 and quant.dequantize(codes, scale, zero).tolist() == [[2.5] * 4]


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_error_bound_and_packing(bits):
    """Random data: a value lands on the nearest level, so its error is at most half a step (b >= 2) or a quarter
    of the range (b = 1: levels at the quarter points), up to float16 parameter rounding."""
    torch.manual_seed(bits)
    x = torch.randn(64, 4, 16) * 3
    packed, scale, zero = quant.quantize_keys(x, bits, group=16)
    deq = quant.dequantize_keys(packed, scale.repeat_interleave(16, 0), zero.repeat_interleave(16, 0), bits)
    span = (x.reshape(4, 16, 4, 16).amax(1) - x.reshape(4, 16, 4, 16).amin(1)).repeat_interleave(16, 0)
    bound = span / 4 if bits == 1 else span / (2**bits - 1) / 2
    assert ((deq - x).abs() <= bound + 1e-2 * span).all()
    codes = torch.randint(0, 2**bits, (5, 3, 16), dtype=torch.uint8)
    assert torch.equal(quant.unpack(quant.pack(codes, bits), bits), codes)


def test_layout_refused():
    with pytest.raises(ValueError, match="must divide head_dim"):
        quant.check_layout(1, 48, 64)
    with pytest.raises(ValueError, match="bits"):
        quant.check_layout(3, 32, 64)
    with pytest.raises(ValueError, match="whole groups"):
        quant.quantize_keys(torch.zeros(5, 1, 8), 1, 4)
