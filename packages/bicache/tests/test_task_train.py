import json

import pytest
import torch

from bicache.task import TableTask, TaskSpec, Vocab
from bicache.train import Recipe, load_or_train, masked_diffusion_loss


def test_layout_and_fractions():
    spec = TaskSpec()
    t = TableTask(spec, seed=0)
    for f in (0.25, 0.5, 0.75, 0.9):
        rows = spec.shared_rows_for_fraction(f)
        reqs = t.burst(3, rows)
        assert abs(reqs[0].prefix_len / spec.prompt_length - f) < 0.05
        for r in reqs:
            assert len(r.prompt) == spec.prompt_length and len(r.answer) == spec.gen_length
            assert r.prompt[: r.prefix_len] == reqs[0].prompt[: r.prefix_len]
            # the answer is the value of the asked key in the table
            key = r.prompt[-1]
            rows_start = 1 + spec.shots * spec.shot_len
            table = {r.prompt[i]: r.prompt[i + 1 : i + 4] for i in range(rows_start, spec.prompt_length - 2, 4)}
            assert table[key] + [t.vocab.eos_id] == r.answer
    with pytest.raises(ValueError, match="shared_rows"):
        t.burst(1, spec.rows + 1)


def test_vocab_roundtrip_and_errors():
    v = Vocab(48)
    ids = v.encode("<bos> ? k03 1 2 3")
    assert v.decode(ids) == "<bos> ? k03 1 2 3"
    with pytest.raises(ValueError, match="'k99' is not in the vocabulary"):
        v.encode("k99")


def test_training_steps_lower_loss_and_cache_is_reused(tmp_path):
    recipe = Recipe(layers=2, hidden=32, heads=2, steps=6, batch=8, eval_every=3, target=2.0)
    dlm = load_or_train(recipe, progress=False, directory=tmp_path)
    path = tmp_path / f"dlm-{recipe.key()}"
    assert (path / "task.json").exists() and not (tmp_path / f"dlm-{recipe.key()}.partial").exists()
    assert json.loads((path / "task.json").read_text())["rows"] == recipe.spec.rows
    again = load_or_train(recipe, progress=False, directory=tmp_path)  # loaded, not retrained
    for a, b in zip(dlm.model.parameters(), again.model.parameters()):
        assert torch.equal(a, b)
    # the loss is a masked-token cross-entropy: finite, positive, and only on maskable tokens
    x, maskable = TableTask(recipe.spec, seed=3).training_batch(4)
    assert maskable[:, recipe.spec.prompt_length :].all()
    loss = masked_diffusion_loss(dlm, x, maskable, torch.Generator().manual_seed(0))
    assert torch.isfinite(loss) and loss > 0
