import math

import pytest
import torch

from geomesh.signcompress import SignCodec, SignCompressor, contraction, pack_signs, unpack_signs


@pytest.mark.parametrize("n", [1, 7, 8, 9, 1000, 4097])
def test_pack_unpack_bit_exact(n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g)
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(n / 8)
    assert torch.equal(unpack_signs(packed, n), x >= 0)


def test_unpack_pack_every_byte_value():
    raw = torch.arange(256, dtype=torch.uint8)
    bits = unpack_signs(raw, 256 * 8)
    assert torch.equal(pack_signs(bits.float() * 2 - 1), raw)
    # MSB first: 0x80 is one set bit in front
    assert unpack_signs(torch.tensor([0x80], dtype=torch.uint8), 8).tolist() == [True] + [False] * 7


def test_codec_layout_decode_and_tokens():
    shapes = [(3, 5), (10,), (2, 2, 2)]
    codec = SignCodec(shapes, chunk_size=4)
    ts = [torch.randn(s) for s in shapes]
    buf = codec.encode(ts, tokens=12345)
    assert buf.dtype == torch.uint8 and buf.numel() == codec.nbytes == 8 + 4 * (4 + 3 + 2) + math.ceil(33 / 8)
    dec, tokens = codec.decode(buf)
    assert tokens == 12345
    for t, d in zip(ts, dec):
        assert d.shape == t.shape
        assert torch.equal(d >= 0, t >= 0)
        flat_t, flat_d = t.reshape(-1), d.reshape(-1)
        for c in range(0, flat_t.numel(), 4):
            assert torch.allclose(
                flat_d[c : c + 4].abs(), flat_t[c : c + 4].abs().mean().expand(len(flat_d[c : c + 4]))
            )
    # decoding is deterministic: the same buffer gives bit-identical tensors
    dec2, _ = codec.decode(buf.clone())
    assert all(torch.equal(a, b) for a, b in zip(dec, dec2))


def test_per_tensor_scale_and_compression_ratio():
    shapes = [(256, 256), (256,)]
    codec = SignCodec(shapes, chunk_size=None)
    assert codec.n_chunks == 2
    fp32 = 4 * (256 * 256 + 256)
    assert codec.nbytes < fp32 / 31


def test_codec_rejects_bad_input():
    codec = SignCodec([(4,)])
    with pytest.raises(ValueError, match="shapes"):
        codec.encode([torch.zeros(5)])
    with pytest.raises(ValueError, match="buffer"):
        codec.decode(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="chunk_size"):
        SignCodec([(4,)], chunk_size=0)


def test_error_feedback_bounds_running_sum():
    """sum(decoded) = sum(true) - residual, and the residual stays below the contraction bound."""
    torch.manual_seed(0)
    shapes = [(64, 32), (100,)]
    chunk = 64
    comp = SignCompressor(shapes, chunk_size=chunk)
    plain = SignCompressor(shapes, chunk_size=chunk, error_feedback=False)
    true_sum = [torch.zeros(s) for s in shapes]
    ef_sum = [torch.zeros(s) for s in shapes]
    plain_sum = [torch.zeros(s) for s in shapes]
    bias = [torch.randn(s) * 0.05 for s in shapes]  # a small consistent drift the plain sign mis-scales
    max_g = 0.0
    worst_delta = 1.0
    gaps = []
    for _ in range(300):
        g = [torch.randn(s) + b for s, b in zip(shapes, bias)]
        target = [x + e for x, e in zip(g, comp.errors)]
        worst_delta = min(worst_delta, *(contraction(t, chunk) for t in target))
        max_g = max(max_g, math.sqrt(sum(float((x * x).sum()) for x in g)))
        d, _ = comp.decode(comp.compress(g))
        p, _ = plain.decode(plain.compress(g))
        for i in range(len(shapes)):
            true_sum[i] += g[i]
            ef_sum[i] += d[i]
            plain_sum[i] += p[i]
        gap = math.sqrt(sum(float(((a - b) ** 2).sum()) for a, b in zip(true_sum, ef_sum)))
        gaps.append(gap)
    # residual identity: the gap is exactly the carried error
    resid = math.sqrt(sum(float((e * e).sum()) for e in comp.errors))
    assert gaps[-1] == pytest.approx(resid, rel=1e-3)
    # ||e_t|| <= q (||e_{t-1}|| + ||g_t||), q = sqrt(1 - delta)  =>  ||e|| <= q / (1 - q) * max ||g||
    q = math.sqrt(1 - worst_delta)
    bound = q / (1 - q) * max_g
    assert max(gaps) <= bound
    assert gaps[-1] < 3 * max_g
    # without error feedback the sums drift apart, growing with the number of rounds
    plain_gap = math.sqrt(sum(float(((a - b) ** 2).sum()) for a, b in zip(true_sum, plain_sum)))
    assert plain_gap > 5 * gaps[-1]


def test_compressor_state_roundtrip():
    comp = SignCompressor([(10,)], chunk_size=None)
    comp.compress([torch.randn(10)])
    other = SignCompressor([(10,)], chunk_size=None)
    other.load_state_dict(comp.state_dict())
    assert torch.equal(other.errors[0], comp.errors[0])
    with pytest.raises(ValueError, match="shapes"):
        SignCompressor([(11,)]).load_state_dict(comp.state_dict())


def test_ef_decay_zero_is_plain_sign_and_bad_decay_rejected():
    g = [torch.randn(40)]
    a = SignCompressor([(40,)], chunk_size=8, ef_decay=0.0)
    b = SignCompressor([(40,)], chunk_size=8, error_feedback=False)
    for _ in range(3):
        assert torch.equal(a.compress(g), b.compress(g))
    with pytest.raises(ValueError, match="ef_decay"):
        SignCompressor([(4,)], ef_decay=1.5)
    with pytest.raises(ValueError, match="scale"):
        SignCodec([(4,)], scale="max")
