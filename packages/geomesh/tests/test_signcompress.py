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


def test_rotation_is_orthogonal_and_invertible():
    shapes = [(3, 5), (64,), (100,), (8, 256), (1030,)]
    codec = SignCodec(shapes, chunk_size=1024, scale="rms", rotate=True, seed=3)
    xs = [torch.randn(s) for s in shapes]
    coded = codec.to_coded(xs)
    flat = torch.cat([x.reshape(-1) for x in xs])
    assert not torch.allclose(coded, flat)  # the power-of-two blocks are rotated
    assert float(coded.norm()) == pytest.approx(float(flat.norm()), rel=1e-5)  # orthogonal
    for a, b in zip(xs, codec.from_coded(coded)):
        assert torch.allclose(a, b, atol=1e-5)
    # the (3, 5) and (100,) tensors have no power-of-two block: only D's signs touch them
    assert torch.equal(coded[:15].abs(), flat[:15].abs())
    assert torch.equal(coded[15 + 64 : 15 + 64 + 100].abs(), flat[15 + 64 : 15 + 64 + 100].abs())
    # the buffer's signs are the signs of the rotated values; the layout and size do not change
    buf = codec.encode(xs, tokens=9)
    assert buf.numel() == SignCodec(shapes, chunk_size=1024).nbytes
    dec_coded, tokens = codec.decode_coded(buf)
    assert tokens == 9 and torch.equal(dec_coded >= 0, coded >= 0)
    # another seed is another rotation; a non-power-of-two chunk cannot be a Hadamard block
    assert not torch.equal(SignCodec(shapes, 1024, rotate=True, seed=4).to_coded(xs), coded)
    with pytest.raises(ValueError, match="power of two"):
        SignCodec(shapes, chunk_size=1000, rotate=True)


def test_rotation_codes_heavy_tailed_chunks_better():
    """Sign coding of a heavy-tailed chunk gives every near-zero entry the chunk's magnitude; after
    the rotation the coordinates are near-Gaussian and the decoded vector points closer to the input."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8192, generator=g) ** 3
    cos = {}
    for rotate in (False, True):
        codec = SignCodec([(8192,)], chunk_size=1024, scale="mean", rotate=rotate)
        d = codec.decode(codec.encode([x]))[0][0]
        cos[rotate] = float((d * x).sum() / (d.norm() * x.norm()))
    assert cos[False] < 0.5 < 0.75 < cos[True]


def test_decode_mean_is_the_weighted_sum_of_decodes():
    shapes = [(64, 16), (33,)]
    for rotate in (False, True):
        codec = SignCodec(shapes, chunk_size=256, scale="rms", rotate=rotate)
        bufs = [codec.encode([torch.randn(s) for s in shapes], tokens=t) for t in (10, 30, 60)]
        assert [codec.tokens_of(b) for b in bufs] == [10, 30, 60]
        w = [0.1, 0.3, 0.6]
        got = codec.decode_mean(bufs, w)
        want = [sum(wk * codec.decode(b)[0][i] for wk, b in zip(w, bufs)) for i in range(len(shapes))]
        for a, b in zip(got, want):
            assert torch.allclose(a, b, atol=1e-6)
        again = codec.decode_mean([b.clone() for b in bufs], w)
        assert all(torch.equal(a, b) for a, b in zip(got, again))  # bit-identical on every worker


def test_rotated_error_feedback_bounds_running_sum_and_state_is_exact():
    torch.manual_seed(1)
    shapes = [(32, 32), (40,)]
    comp = SignCompressor(shapes, chunk_size=256, scale="rms", rotate=True)
    true_sum = [torch.zeros(s) for s in shapes]
    ef_sum = [torch.zeros(s) for s in shapes]
    bias = [torch.randn(s) * 0.05 for s in shapes]
    max_g, gaps = 0.0, []
    for _ in range(200):
        g = [torch.randn(s) + b for s, b in zip(shapes, bias)]
        max_g = max(max_g, math.sqrt(sum(float((x * x).sum()) for x in g)))
        d, _ = comp.decode(comp.compress(g))
        for i in range(len(shapes)):
            true_sum[i] += g[i]
            ef_sum[i] += d[i]
        gaps.append(math.sqrt(sum(float(((a - b) ** 2).sum()) for a, b in zip(true_sum, ef_sum))))
    resid = math.sqrt(sum(float((e * e).sum()) for e in comp.errors))
    assert gaps[-1] == pytest.approx(resid, rel=1e-3)  # the gap is the carried residual
    assert max(gaps) < 3 * max_g
    assert 0.5 < comp.last_stats["cosine"] <= 1.0
    other = SignCompressor(shapes, chunk_size=256, scale="rms", rotate=True)
    other.load_state_dict(comp.state_dict())
    g = [torch.randn(s) for s in shapes]
    assert torch.equal(other.compress(g), comp.compress(g))  # resumed residual is bit-exact


def test_residual_survives_a_change_of_chunk_size():
    """A residual saved in one rotated basis and loaded into a codec with another chunk size is
    carried over as the same coordinate-basis error, not as the raw coded vector."""
    shapes = [(64, 32)]
    a = SignCompressor(shapes, chunk_size=1024, scale="rms", rotate=True)
    a.compress([torch.randn(s) for s in shapes])
    b = SignCompressor(shapes, chunk_size=256, scale="rms", rotate=True)
    b.load_state_dict(a.state_dict())
    for ea, eb in zip(a.errors, b.errors):
        assert torch.allclose(ea, eb, atol=1e-5)
