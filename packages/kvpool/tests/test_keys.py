import pytest
import torch

from kvpool import KVLayout, chunk_keys, longest_prefix, unit_name

LAY = KVLayout(2, 2, 8, chunk_tokens=4)


def test_chained_keys_share_prefix_and_diverge_after_a_change():
    a = list(range(20))
    b = a[:9] + [999] + a[10:]
    ka, kb = chunk_keys(a, "m", LAY), chunk_keys(b, "m", LAY)
    assert len(ka) == 5 and [k.index for k in ka] == [0, 1, 2, 3, 4]
    assert ka[0] == kb[0] and ka[1] == kb[1]
    # chunk 2 holds token 9; every later key depends on it through the chain
    assert all(x.hex != y.hex for x, y in zip(ka[2:], kb[2:]))
    assert len({k.hex for k in ka}) == 5


def test_partial_chunk_gets_no_key_and_tensor_input_matches_list():
    toks = list(range(11))
    assert len(chunk_keys(toks, "m", LAY)) == 2
    assert chunk_keys(torch.tensor(toks), "m", LAY) == chunk_keys(toks, "m", LAY)


def test_model_and_layout_are_in_every_key():
    toks = list(range(8))
    base = {k.hex for k in chunk_keys(toks, "m", LAY)}
    other_model = {k.hex for k in chunk_keys(toks, "m2", LAY)}
    other_layout = {k.hex for k in chunk_keys(toks, "m", KVLayout(2, 2, 8, "float16", 4))}
    assert not base & other_model and not base & other_layout


def test_longest_prefix_stops_at_first_gap():
    keys = chunk_keys(list(range(20)), "m", LAY)
    have = {keys[0].hex, keys[1].hex, keys[3].hex}
    assert longest_prefix(keys, have) == 2
    assert longest_prefix(keys, lambda h: True) == 5
    assert longest_prefix(keys, set()) == 0


def test_layout_sizes_and_bad_input():
    assert LAY.unit_bytes == 2 * 2 * 4 * 8 * 4 and LAY.chunk_bytes == 2 * LAY.unit_bytes
    assert unit_name(chunk_keys(range(4), "m", LAY)[0], 1).endswith(".1")
    with pytest.raises(ValueError, match="kv_heads"):
        KVLayout(2, 0, 8)
    with pytest.raises(ValueError, match="dtype"):
        KVLayout(2, 2, 8, "int7")
    with pytest.raises(ValueError, match="model_id"):
        chunk_keys([1, 2, 3, 4], "", LAY)
    with pytest.raises(ValueError, match="1-D"):
        chunk_keys([[1, 2, 3, 4]], "m", LAY)
