from parser_moe.data import SPLITS, split_files, split_text, stdlib_files


def test_every_file_is_in_exactly_one_split_and_eval_is_dev_plus_test():
    parts = {s: {f.name for f in split_files(s)} for s in ("train", "calib", "dev", "test")}
    assert sum(len(v) for v in parts.values()) == len(stdlib_files())
    names = list(parts)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            assert not parts[a] & parts[b], (a, b)
    assert {f.name for f in split_files("eval")} == parts["dev"] | parts["test"]
    assert parts["dev"] and parts["test"]


def test_training_files_are_the_ones_outside_every_fifth_file():
    # the shipped checkpoints were trained on these files: the dev/test split must not move them
    expected = {f.name for i, f in enumerate(stdlib_files()) if i % 10 not in (0, 5)}
    assert {f.name for f in split_files("train")} == expected


def test_unknown_split_names_the_valid_ones():
    import pytest

    with pytest.raises(ValueError, match="split must be one of train, calib, eval, dev, test"):
        split_text("holdout")
    assert set(SPLITS) == {"train", "calib", "eval", "dev", "test"}
