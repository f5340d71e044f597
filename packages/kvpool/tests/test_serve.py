import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("aiohttp")

from kvpool import KVPool, MemoryStore, PassthroughStore  # noqa: E402
from kvpool.serve import BackgroundServer, PoolClient, parse_layout  # noqa: E402

LAY = parse_layout("L2-H2-D8-float32-N16")


def test_layout_tags_round_trip_and_reject_garbage():
    assert LAY.tag() == "L2-H2-D8-float32-N16"
    with pytest.raises(ValueError, match="layout tag"):
        parse_layout("16 layers")


def test_two_processes_share_one_pool_over_http(ssd_dirs):
    stores = [MemoryStore("mem0", 2 * LAY.chunk_bytes), PassthroughStore("ssd0", ssd_dirs[0], 1 << 20)]
    with KVPool(stores, LAY, "m", {"mem0": 8e9, "ssd0": 1e9}) as pool, BackgroundServer(pool) as srv:
        c = PoolClient(srv.url, model_id="m", layout=LAY)
        chunk = torch.randn(2, 2, 2, 16, 8)
        key = "0123456789abcdef0123456789abcdef"
        assert c.put_chunk(key, chunk)
        # a second process (another serving engine) reads what the first stored
        code = textwrap.dedent(
            f"""
            import torch
            from kvpool.serve import PoolClient
            c = PoolClient({srv.url!r})
            t = c.get_chunk({key!r})
            torch.save(t, {str(ssd_dirs[1] / "got.pt")!r})
            print(c.lookup([{key!r}, "f" * 32]))
            """
        )
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == "1"
        assert torch.equal(torch.load(ssd_dirs[1] / "got.pt"), chunk)
        assert c.get_chunk("f" * 32) is None
        st = c.stats()
        assert st["counters"]["chunks_stored"] == 1 and "page_cache_bytes" in st
        with pytest.raises(ValueError, match="not 'other'"):
            PoolClient(srv.url, model_id="other")
        import urllib.error

        with pytest.raises(urllib.error.HTTPError):
            c.put_chunk(key[:8], chunk)
