import importlib
import json

import pytest
import torch

from bicache.task import TableTask, TaskSpec, Vocab
from bicache.train import Recipe, load_or_train, masked_diffusion_loss, train


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
            # the answer is the value of the asked key in the table (parsed from the token text)
            v = t.vocab
            key = v.tokens[r.prompt[-1]]
            table = {}
            for tok in v.decode(r.prompt[spec.rows_start : spec.prompt_length - 2]).split():
                k, rest = tok.split(".")
                table.setdefault(k, []).append(rest.split("=")[1])
            assert len(table) == spec.rows
            assert v.decode(r.answer) == " ".join(table[key]) + " <eos>" * (spec.answer_length - spec.value_digits)
    with pytest.raises(ValueError, match="shared_rows"):
        t.burst(1, spec.rows + 1)


def test_vocab_roundtrip_and_errors():
    v = Vocab(48)
    ids = v.encode("<bos> k03.0=1 k03.1=2 k03.2=3 ? k03")
    assert len(ids) == 6 and v.decode(ids) == "<bos> k03.0=1 k03.1=2 k03.2=3 ? k03"
    with pytest.raises(ValueError, match="'k99' is not in the vocabulary"):
        v.encode("k99")
    with pytest.raises(ValueError, match="n_keys"):
        TaskSpec(n_keys=4, rows=12)


def test_open_vocab_spells_unknown_words_as_bytes():
    v = Vocab(16)
    text = 'You are an agent. {"question": "json décoder"} ? k02 3'
    ids = v.encode(text, open_vocab=True)
    assert all(0 <= i < len(v) for i in ids)
    assert ids[-3:] == v.encode("? k02 3")  # task words keep their own tokens
    assert v.decode(ids) == text  # single spaces round-trip exactly
    assert sum(i >= v.byte0 for i in ids) == len('You are an agent. {"question": "json décoder"}'.encode())


def test_curriculum_pads_rows_but_keeps_the_asked_one():
    spec = TaskSpec()
    t = TableTask(spec, seed=5)
    x, maskable = t.training_batch(16, rows=2)
    v = t.vocab
    for seq, m in zip(x.tolist(), maskable.tolist()):
        table = seq[spec.rows_start : spec.prompt_length - 2]
        assert sum(tok == v.pad_id for tok in table) >= (spec.rows - 2 - spec.shots) * spec.row_len
        asked = seq[spec.prompt_length - 1] - v.key0
        answer = [tok - v.digit0 for tok in seq[spec.prompt_length : spec.prompt_length + spec.value_digits]]
        assert all(v.keyed(asked, j, d) in table for j, d in enumerate(answer))
        assert all(m[spec.prompt_length :]) and not any(m[spec.rows_start : spec.prompt_length])


def test_training_steps_lower_loss_and_cache_is_reused(tmp_path):
    recipe = Recipe(layers=2, local_layers=1, hidden=32, heads=2, steps=6, batch=8, eval_every=3, target=2.0)
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


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_llada_and_dream_shaped_recipes_train_and_reload(tmp_path, arch):
    recipe = Recipe(arch=arch, layers=2, local_layers=0, hidden=32, heads=2, steps=3, batch=4, eval_every=3, target=2.0)
    dlm = load_or_train(recipe, progress=False, directory=tmp_path)
    assert type(dlm.model).__name__ == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]
    again = load_or_train(recipe, progress=False, directory=tmp_path)  # loaded from its checkpoint
    assert type(again.model) is type(dlm.model)
    for a, b in zip(dlm.model.parameters(), again.model.parameters()):
        assert torch.equal(a, b)
    assert recipe.key() != Recipe(layers=2, local_layers=0, hidden=32, heads=2, steps=3, batch=4).key()
    with pytest.raises(ValueError, match="Recipe.local_layers must be 0 for arch"):
        train(Recipe(arch=arch, layers=1, hidden=16, heads=2, steps=1), progress=False)


def test_gemma3_recipe_keys_are_unchanged_by_the_arch_field():
    # the keys these recipes had before ``arch`` existed: a user's trained checkpoints stay found
    assert Recipe().key() == "b512af87d2bd"
    assert Recipe(layers=2).key() == "9fd6af8222fc"


def test_mixed_curriculum_draws_row_counts_in_range():
    spec = TaskSpec()
    t = TableTask(spec, seed=6)
    x, _ = t.training_batch(64, rows=6, min_rows=2)
    filled = [
        sum(tok != t.vocab.pad_id for tok in seq[spec.rows_start : spec.rows_start + spec.rows * spec.row_len])
        for seq in x.tolist()
    ]
    assert min(filled) >= 2 and max(filled) <= 6 and len(set(filled)) >= 3  # phases mixed, not one level


def test_curriculum_level_advances_on_patience(tmp_path):
    # the gate (exact match 2.0) is unreachable: only the patience rule can advance the level
    recipe = Recipe(
        layers=1,
        local_layers=0,
        hidden=16,
        heads=2,
        steps=4,
        batch=4,
        eval_every=1,
        val_requests=8,
        patience=1,
        curriculum_gate=2.0,
        target=2.0,
    )
    train(recipe, progress=False, resume_dir=tmp_path)
    state = torch.load(tmp_path / "train-state.pt", weights_only=True)
    assert state["step"] == 4 and state["rows"] == recipe.min_rows + 4


def test_the_default_recipe_ships_its_checkpoint_and_a_first_run_does_not_train(tmp_path, monkeypatch):
    bt = importlib.import_module("bicache.train")  # the module: the package exports train() by that name
    shipped = bt.SHIPPED_DIR / f"dlm-{Recipe().key()}"
    assert (shipped / "task.json").is_file() and (shipped / "model.safetensors").is_file()
    assert json.loads((shipped / "recipe.json").read_text())["key"] == Recipe().key()
    monkeypatch.setenv("BICACHE_CACHE_DIR", str(tmp_path))  # an empty user cache

    def no_training(*args, **kwargs):
        raise AssertionError("trained although the package ships this recipe's checkpoint")

    monkeypatch.setattr(bt, "train", no_training)
    dlm = load_or_train(progress=False)
    assert type(dlm.model).__name__ == "Gemma3ForCausalLM" and dlm.spec == Recipe().spec
    # a user's own cache wins over the shipped checkpoint; an explicit directory never falls back to it
    with pytest.raises(AssertionError, match="trained although"):
        load_or_train(progress=False, directory=tmp_path / "elsewhere")
