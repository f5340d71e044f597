import torch
from conftest import tiny_model

from parser_moe.tasks import CHOICES, Item, accuracy, build_tasks, byte_encoder, choice_scores, run_tasks


def test_items_come_from_held_out_files_with_four_distinct_choices():
    tasks = build_tasks("test", n=12, seed=0)
    assert set(tasks) == {"docstring_mc", "identifier_mc"}
    for name, items in tasks.items():
        assert len(items) == 12, name
        for it in items:
            assert len(set(it.choices)) == CHOICES and 0 <= it.answer < CHOICES
    assert all(
        it.context.endswith('    """') and it.context.startswith(("def ", "async def ")) for it in tasks["docstring_mc"]
    )
    assert build_tasks("test", n=12, seed=0) == tasks  # same questions for every model
    assert build_tasks("test", n=12, seed=1) != tasks


def test_choice_scores_equal_the_mean_log_likelihood_of_each_choice_alone():
    model = tiny_model("qwen2_moe")
    enc = byte_encoder(64)
    items = [
        Item("def f(x):", ("return x", "pass", "yield x + 1", "x"), 0),
        Item("import o", ("s", "ss", "sys", "pathlib"), 2),
    ]
    got = choice_scores(model, items, enc, batch_size=3)  # padding across items of different lengths
    for it, row in zip(items, got):
        for choice, score in zip(it.choices, row):
            ctx, ch = enc(it.context), enc(choice)
            ids = torch.tensor([ctx + ch])
            with torch.no_grad():
                logp = model(input_ids=ids).logits[0].log_softmax(-1)
            want = sum(float(logp[len(ctx) - 1 + i, t]) for i, t in enumerate(ch)) / len(ch)
            assert abs(score - want) < 1e-4


def test_accuracy_counts_the_best_scored_choice(monkeypatch):
    import parser_moe.tasks as tasks

    items = [Item("a", ("1", "2", "3", "4"), 1), Item("b", ("1", "2", "3", "4"), 3)]
    monkeypatch.setattr(tasks, "choice_scores", lambda m, it, e: [[0, 5, 1, 2], [0, 5, 1, 2]])
    assert accuracy(None, items, byte_encoder(256)) == 0.5
    out = run_tasks(None, {"docstring_mc": items, "identifier_mc": items}, byte_encoder(256), 0.25)
    assert out["next_token"] == 0.25 and out["docstring_mc"] == out["identifier_mc"] == 0.5
    assert abs(out["mean"] - (0.25 + 0.5 + 0.5) / 3) < 1e-12
