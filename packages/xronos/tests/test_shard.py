import pytest
import torch
from dist_helpers import hf_parity

from xronos.launch import spawn
from xronos.shard import build_model, tiny_config


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory):
    save = tmp_path_factory.mktemp("full")
    res = spawn(hf_parity, 2, (["llama", "qwen2"], (3, 1), (9, 3), str(save)), timeout_s=300)
    return res, save


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_uneven_sharded_model_matches_full_model(family, sharded_runs):
    runs, save_root = sharded_runs
    res = [r[family] for r in runs]
    save = save_root / family
    cfg = tiny_config(
        family, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4
    )
    ref = build_model(cfg, seed=3)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))
    out = ref(input_ids=ids, labels=ids)
    out.loss.backward()
    params = dict(ref.named_parameters())
    head_dim = 8
    assert res[0]["heads"] == (6, 3, 6 * head_dim, 3 * head_dim)
    assert res[1]["heads"] == (2, 1, 2 * head_dim, 1 * head_dim)
    for r in res:
        torch.testing.assert_close(r["logits"], out.logits.detach(), rtol=1e-5, atol=1e-5)
        for k, g in r["grads"].items():
            torch.testing.assert_close(g, params[k].grad, rtol=1e-4, atol=1e-6, msg=k)
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(r["state"][k], v, rtol=0, atol=0, msg=k)
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(save, attn_implementation="sdpa")
    torch.testing.assert_close(loaded(input_ids=ids).logits, out.logits.detach(), rtol=1e-5, atol=1e-5)


def test_partition_world_size_mismatch_is_one_clear_error():
    from xronos.partition import ModelShape, PartitionError, even_partition
    from xronos.shard import shard_model

    cfg = tiny_config(
        "llama", hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=4
    )
    model = build_model(cfg)
    with pytest.raises(PartitionError, match="partition has 2 ranks but the world size is 1"):
        shard_model(model, even_partition(ModelShape.from_config(cfg, mlp_block=8), 2), 0)
    other = ModelShape(
        hidden_size=64, num_heads=4, num_kv_heads=4, head_dim=16, intermediate_size=96, num_layers=1, mlp_block=8
    )
    with pytest.raises(PartitionError, match="was made for 4 heads"):
        shard_model(model, even_partition(other, 1), 0)


def test_torchrun_env_missing_is_named(monkeypatch):
    from xronos.launch import WorkerError, init_from_env

    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(WorkerError, match="RANK is not set"):
        init_from_env()
