import pytest
import torch
from dist_helpers import small_cfg

from xronos.partition import even_partition
from xronos.train import TPTrainer, split_layers


@pytest.fixture
def runs(train_runs):
    return train_runs


@pytest.fixture(scope="module")
def reference():
    ref = TPTrainer(small_cfg(), None)
    losses = [ref.step()["loss"] for _ in range(4)]
    return ref, losses, ref.evaluate()


@pytest.mark.slow
def test_uneven_tp_full_finetune_matches_reference(runs, reference):
    ref, losses, ev = reference
    for r in runs:
        assert r["full"] == pytest.approx(losses, rel=1e-5)
        assert r["eval"] == pytest.approx(ev, rel=1e-5)
    for k, v in ref.model.state_dict().items():
        torch.testing.assert_close(runs[0]["state"][k], v, rtol=1e-4, atol=1e-5, msg=k)


@pytest.mark.slow
def test_checkpoint_resume_is_exact(runs):
    for r in runs:
        assert r["resumed"] == r["full"]
        assert r["same_state"]
        assert "was saved with partition" in r["mismatch"]


@pytest.mark.slow
def test_sharded_lora_matches_single_process_lora(runs):
    cfg = small_cfg(lora_r=4)
    ref = TPTrainer(cfg, even_partition(cfg.shape(), 1))
    losses = [ref.step()["loss"] for _ in range(3)]
    assert losses[2] != losses[0]  # it trains
    total = sum(p.numel() for p in ref.params)
    assert runs[0]["lora_params"] + runs[1]["lora_params"] > total  # replicated halves counted twice
    for r in runs:
        assert r["lora"] == pytest.approx(losses, rel=1e-5)
        # the pipeline baseline runs the same LoRA fine-tune: same adapters, same losses
        assert r["pp_lora"] == pytest.approx(losses, rel=1e-5)
    assert runs[0]["pp_lora_params"] + runs[1]["pp_lora_params"] == total  # each stage trains its layers' adapters


@pytest.mark.slow
def test_pipeline_baseline_matches_reference(runs, reference):
    _, losses, ev = reference
    for r in runs:
        assert r["pp"] == pytest.approx(losses[:2], rel=1e-5)


def test_split_layers_proportional():
    assert split_layers(4, [1.0, 0.5]) == [3, 1]
    assert split_layers(4, [1.0, 1.0]) == [2, 2]
    assert split_layers(3, [1.0, 0.01, 0.01]) == [1, 1, 1]
    with pytest.raises(ValueError, match="cannot make 3 pipeline stages"):
        split_layers(2, [1, 1, 1])


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="micro_batches"):
        small_cfg(batch=3, micro_batches=2).validate()
    with pytest.raises(ValueError, match="hidden"):
        small_cfg(hidden=0).validate()


def test_trainer_rejects_a_bad_partition_before_building_anything(monkeypatch):
    import xronos.train as train
    from xronos.partition import Partition, PartitionError

    built = []
    monkeypatch.setattr(train, "build_model", lambda *a, **k: built.append(1))
    cfg = small_cfg()
    with pytest.raises(PartitionError, match="the partition has 2 ranks but the world size is 1"):
        TPTrainer(cfg, Partition(cfg.shape(), (3, 1), (5, 3)))
    other = small_cfg(heads=4, kv_heads=4)
    with pytest.raises(PartitionError, match="made for 4 heads"):
        TPTrainer(cfg, even_partition(other.shape(), 1))
    with pytest.raises(ValueError, match="one-rank partition"):
        TPTrainer(small_cfg(lora_r=2), None)
    with pytest.raises(ValueError, match="cannot make 3 pipeline stages"):
        train.PPTrainer(cfg, [1.0, 1.0, 1.0], 0, 3)
    assert built == []
