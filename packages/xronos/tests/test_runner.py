import pytest
from dist_helpers import small_cfg

from xronos.train import TPTrainer


@pytest.mark.slow
def test_train_resumes_across_partitions_and_saves_full_model(train_runs):
    first, second = train_runs[0]["runner"]["first"], train_runs[0]["runner"]["second"]
    assert first["resumed_from"] is None and len(first["losses"]) == 2
    assert first["partition"]["mlp_columns"] == [64, 64]
    # resumed under Xronos (rank 1 emulated at half speed): the even checkpoint is resharded to the profile
    assert second["resumed_from"] == 2 and len(second["losses"]) == 1
    ref = TPTrainer(small_cfg(steps=3), None)
    losses = [ref.step()["loss"] for _ in range(3)]
    assert first["losses"] + second["losses"] == pytest.approx(losses, rel=1e-5)
    assert second["eval_loss"] == pytest.approx(ref.evaluate(), rel=1e-5)
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(train_runs[0]["runner"]["model"])
    for k, v in ref.model.state_dict().items():
        assert (loaded.state_dict()[k] - v).abs().max() < 1e-4, k


def test_pin_ranks_packs_quotas_onto_cpus_or_refuses():
    from xronos.launch import pin_ranks

    assert pin_ranks([1.0, 0.5], cpus=[0, 1]) == [0, 1]
    assert pin_ranks([0.9, 0.63, 0.36], cpus=[0, 1]) == [0, 1, 1]  # the two slow ranks share a core
    assert pin_ranks([0.7, 0.56, 0.42, 0.28], cpus=[2, 3]) == [2, 3, 3, 2]
    assert pin_ranks([1.0, 0.7, 0.4], cpus=[0, 1]) is None  # 2.1 CPUs of quota do not fit 2 CPUs
