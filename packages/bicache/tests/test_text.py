"""The stdlib-text task, the resumable text training and the over-seeds headline."""

from __future__ import annotations

import pytest
import torch

from bicache import corpus, textbench, texttrain

SPEC = corpus.TextSpec(prompt_length=40, answer_length=4, min_context=8, min_private=6)


@pytest.fixture(scope="module")
def files():
    return corpus.stdlib_files()


def test_splits_are_disjoint_and_deterministic(files):
    assert all(files[s] for s in corpus.SPLITS)
    names = {s: {p.as_posix() for p in files[s]} for s in corpus.SPLITS}
    assert not names["train"] & names["dev"] and not names["train"] & names["test"] and not names["dev"] & names["test"]
    assert corpus.stdlib_files() == files


@pytest.mark.parametrize("kind", corpus.KINDS)
def test_burst_shares_the_prefix_and_answers_come_from_it(files, kind):
    task = corpus.TextTask(SPEC, files["dev"][:20], seed=3)
    p = SPEC.prefix_for_fraction(0.5)
    reqs = task.burst(6, p, kind=kind)
    v = task.vocab
    for r in reqs:
        assert len(r.prompt) == SPEC.prompt_length and len(r.answer) == SPEC.answer_length
        assert r.prompt[:p] == reqs[0].prompt[:p] and r.prefix_len == p and r.prompt[0] == v.bos_id
        context = bytes(t - v.byte0 for t in r.prompt[1:p])
        assert bytes(t - v.byte0 for t in r.answer) in context
        assert r.prompt[p] == (v.sep_id if kind == "completion" else v.fim_id)
    assert len({tuple(r.prompt) for r in reqs}) > 1  # the private parts differ


def test_bad_kind_and_fraction_are_named(files):
    task = corpus.TextTask(SPEC, files["dev"][:5])
    with pytest.raises(ValueError, match="kind must be one of completion, infill"):
        task.burst(2, 20, kind="chat")
    with pytest.raises(ValueError, match="fraction must lie in"):
        SPEC.prefix_for_fraction(1.0)
    with pytest.raises(ValueError, match="prompt_length"):
        corpus.TextSpec(prompt_length=10)


def test_training_batch_marks_the_answer(files):
    task = corpus.TextTask(SPEC, files["train"][:20], seed=1)
    x, answer = task.training_batch(8)
    assert x.shape == (8, SPEC.seq_length)
    assert answer[:, SPEC.prompt_length :].all() and not answer[:, : SPEC.prompt_length].any()
    assert (x[:, 0] == task.vocab.bos_id).all()


TINY = texttrain.TextRecipe(layers=2, hidden=32, heads=2, steps=6, batch=4, warmup=2, spec=SPEC)


def test_interrupted_training_resumes_to_the_same_weights(tmp_path):
    whole = texttrain.train_text(TINY, tmp_path / "a", save_every=3)
    assert texttrain.train_text(TINY, tmp_path / "b", save_every=3, budget_s=0) is None  # stops at step 3
    resumed = texttrain.train_text(TINY, tmp_path / "b", save_every=3)
    for (name, a), b in zip(whole.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name


def test_state_of_another_recipe_is_refused(tmp_path):
    texttrain.train_text(TINY, tmp_path / "s", save_every=3, budget_s=0)
    other = texttrain.TextRecipe(layers=3, hidden=32, heads=2, steps=6, batch=4, spec=SPEC)
    with pytest.raises(ValueError, match="does not match the recipe's model"):
        texttrain.train_text(other, tmp_path / "s")


def test_saved_text_model_loads_back(tmp_path):
    dlm = texttrain.build(TINY)
    texttrain.save_text_model(dlm, TINY, tmp_path / "m")
    back, recipe = texttrain.load_text_model(tmp_path / "m")
    assert recipe == TINY and back.num_layers == 2 and set(back.layer_types) == {"full_attention"}
    ids = torch.randint(dlm.vocab.byte0, len(dlm.vocab), (1, 12))
    with torch.no_grad():
        a, b = dlm.model(ids).logits, back.model(ids).logits
    assert torch.allclose(a, b, atol=0.05)  # fp16 weights on disk
    with pytest.raises(FileNotFoundError, match="text.json missing"):
        texttrain.load_text_model(tmp_path)


def test_headline_is_the_median_over_seeds_with_spread():
    def seed(ratio: float, depth: int) -> dict:
        cal = {"fractions": [0.5], "kv": [[0.0, 0.1]], "drift": [[0.1, 0.2]]}
        return {
            "headline": {"throughput_ratio_vs_dual_cache": ratio},
            "safe_depth": {"0.5": depth},
            "calibration": cal,
            "config": {"drift_bound": 0.1},
        }

    head = textbench.aggregate({0: seed(1.3, 0), 1: seed(0.9, 1), 2: seed(1.1, 0)})
    assert head["throughput_ratio_vs_dual_cache"] == 1.1 and head["seeds"] == [0, 1, 2]
    sp = head["throughput_ratio_vs_dual_cache_spread"]
    assert sp["per_seed"] == [1.3, 0.9, 1.1] and sp["min"] == 0.9 and sp["max"] == 1.3
    assert head["safe_depth_all_global"] == 0 and head["safe_depth_all_global_spread"]["per_seed"] == [0, 1, 0]
    assert head["drift_curve_all_global"][1]["exposed_drift_by_depth"] == [[0.1, 0.2]]


def test_accuracy_keys_are_per_byte_with_exact_match_kept():
    def row(tok: float, exact: float) -> dict:
        return {"0.5": {"token_accuracy": tok, "accuracy": exact}, "0.9": {"token_accuracy": tok, "accuracy": exact}}

    results = {
        "nocache": row(0.6, 0.1),
        "naive_prefix": row(0.2, 0.0),
        "bicache": row(0.6, 0.1),
        "block_cache": row(0.58, 0.1),
        "bicache+block_cache": row(0.5, 0.0),
    }
    head = {"acc_nocache": 0.1, "acc_drop_vs_dual_cache": 0.1}
    keys = textbench._token_keys(head, results)
    assert keys["acc_nocache"] == 0.6 and keys["acc_naive_prefix"] == 0.2 and keys["acc_drop_bicache"] == 0.0
    assert keys["acc_drop_vs_dual_cache"] == 0.08 and keys["exact_acc_nocache"] == 0.1


def test_dual_cache_block_is_the_longest_within_the_accuracy_budget(monkeypatch):
    from bicache.task import Request

    dlm = texttrain.build(TINY)
    reqs = [Request([2] * SPEC.prompt_length, [7, 8, 9, 10], prefix_len=20) for _ in range(4)]
    monkeypatch.setattr(textbench, "_bursts", lambda task, f, n: [reqs])
    answers = torch.tensor([r.answer for r in reqs])

    def fake_generate(dlm, ids, cfg, mode):
        out = answers.repeat(ids.shape[0] // len(reqs), 1)
        if mode == "block":  # a quarter of the bytes wrong at block 4, half at block 8
            out[:, : cfg.block_length // 4] = 0
        return out

    monkeypatch.setattr(textbench.diffusion, "generate", fake_generate)
    cfg, report = textbench.dev_block_length(dlm, quick=True)
    assert cfg.block_length == 2 and report["4"]["token_acc_dual_cache"] == 0.75
    assert textbench.dev_block_length(dlm, quick=True, max_drop=0.3)[0].block_length == 4
