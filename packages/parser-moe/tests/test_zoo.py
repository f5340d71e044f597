import torch

from parser_moe import find_moe_layers, load_seed
from parser_moe.data import sequences
from parser_moe.evaluate import lm_scores
from parser_moe.zoo import SEEDS, available_seeds, checkpoint_dir, train_seed


def test_the_shipped_checkpoints_load_in_float32_and_are_trained_models():
    assert available_seeds() == list(SEEDS) and len(SEEDS) >= 3
    ids = sequences("test", 4, 128, seed=0)
    losses = set()
    for s in SEEDS:
        model, info = load_seed(s)
        assert next(model.parameters()).dtype == torch.float32
        assert info["config"]["seed"] == s and info["stored_dtype"] == "float16"
        layers = find_moe_layers(model)
        assert len(layers) == 4 and layers[0].num_experts == 8 and layers[0].hidden == 96
        ppl, acc = lm_scores(model, ids)
        assert ppl < 20 and acc > 0.3  # an untrained byte model sits near 256 and 1/256
        losses.add(round(info["final_loss"], 6))
    assert len(losses) == len(SEEDS)  # independently trained, not copies


def test_train_seed_writes_a_loadable_checkpoint_atomically(tmp_path):
    out = train_seed(7, tmp_path, steps=2, progress=False)
    assert out == checkpoint_dir(7, tmp_path) and sorted(p.name for p in tmp_path.iterdir()) == [out.name]
    assert (out / "model.safetensors").stat().st_size < 3_000_000  # float16 on disk
    import pytest

    with pytest.raises(FileNotFoundError, match="parser-moe train"):
        load_seed(7)
