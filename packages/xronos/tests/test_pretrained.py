"""Pretrained checkpoints: uneven shards read slice by slice from several safetensors files, the
sharded loss against ``from_pretrained``, and a LoRA-merged save that ``from_pretrained`` loads."""

import json

import pytest
import torch
from pretrained_workers import ATTN_UNITS, MLP_UNITS, fixed_ids, shard_lora_save

from xronos.launch import spawn
from xronos.partition import even_partition
from xronos.pretrained import SUPPORTED, PretrainedError, inspect_checkpoint, load_sharded, model_shape
from xronos.shard import build_model, tiny_config

FAMILIES = ("llama", "qwen2", "mistral")


def _tiny(family):
    return tiny_config(
        family, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4
    )


def _reference(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()


def _headers(path):
    """tensor name -> full shape, from the safetensors headers of every file."""
    from safetensors import safe_open

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, "pt") as h:
            out.update({k: tuple(h.get_slice(k).get_shape()) for k in h.keys()})
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pretrained")
    dirs = {}
    for i, family in enumerate(FAMILIES):
        path = root / family
        build_model(_tiny(family), seed=11 + i).save_pretrained(path, max_shard_size="100KB")
        dirs[family] = path
    results = spawn(shard_lora_save, 2, ({f: str(p) for f, p in dirs.items()}, str(root / "merged")), timeout_s=500)
    return dirs, root / "merged", results


def test_the_source_checkpoints_span_several_files(runs):
    dirs, _, _ = runs
    for path in dirs.values():
        assert (path / "model.safetensors.index.json").is_file()
        assert len(list(path.glob("*.safetensors"))) >= 3


@pytest.mark.parametrize("family", FAMILIES)
def test_each_rank_reads_only_its_share(runs, family):
    dirs, _, results = runs
    full = _headers(dirs[family])
    total = sum(torch.Size(s).numel() for s in full.values())
    by_rank = [r[family] for r in results]
    for rank, r in enumerate(by_rank):
        assert r["bytes_read"] == 4 * r["params_held"]  # fp32: every byte read is a parameter held
        assert r["model_params"] == r["params_held"]
        assert r["params_held"] < 0.85 * total
        q = r["reads"]["model.layers.0.self_attn.q_proj.weight"]
        assert q == (ATTN_UNITS[rank] * 2 * 8, 64)  # its query heads' rows only (head_dim 8)
        assert r["reads"]["model.layers.1.mlp.down_proj.weight"] == (64, MLP_UNITS[rank] * 16)
        for name, shape in r["shapes"].items():
            if any(k in name for k in ("_proj", "lm_head")):  # no full-size projection on any rank
                assert shape != full[name], name
    replicated = sum(torch.Size(s).numel() for k, s in full.items() if by_rank[0]["reads"][k] == s)
    # the split tensors' slices tile them exactly: nothing read twice, nothing missed
    assert by_rank[0]["params_held"] + by_rank[1]["params_held"] == total + replicated


@pytest.mark.parametrize("family", FAMILIES)
def test_sharded_forward_matches_from_pretrained(runs, family):
    dirs, _, results = runs
    ref = _reference(dirs[family])
    ids = fixed_ids()
    with torch.no_grad():
        out = ref(input_ids=ids, labels=ids)
    for r in results:
        assert r[family]["loss"] == pytest.approx(out.loss.item(), rel=1e-5)
        torch.testing.assert_close(r[family]["before"], out.logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_merged_checkpoint_loads_with_the_fine_tuned_logits(runs, family):
    _, merged, results = runs
    r0 = results[0][family]
    assert r0["saved"] == str(merged / family) and results[1][family]["saved"] is None
    assert (merged / family / "model.safetensors.index.json").is_file()
    assert (r0["after"] - r0["before"]).abs().max() > 1e-3  # the adapters did change the model
    with torch.no_grad():
        logits = _reference(merged / family)(input_ids=fixed_ids()).logits
    torch.testing.assert_close(logits, r0["after"], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(r0["after"], results[1][family]["after"])


def test_a_directory_without_safetensors_names_what_it_holds(tmp_path):
    _tiny("llama").save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(PretrainedError, match=r"no safetensors weights.*found: config\.json, pytorch_model\.bin"):
        inspect_checkpoint(tmp_path)


def test_an_unknown_architecture_names_it_and_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(PretrainedError, match=r"'gpt2' \(architectures \['GPT2LMHeadModel'\]\).*llama, qwen2"):
        inspect_checkpoint(tmp_path)
    assert set(SUPPORTED) == set(FAMILIES)


def test_missing_directory_config_and_tensor(tmp_path):
    with pytest.raises(PretrainedError, match="does not exist"):
        inspect_checkpoint(tmp_path / "absent")
    with pytest.raises(PretrainedError, match="no config.json; found: nothing"):
        inspect_checkpoint(tmp_path)
    model = build_model(_tiny("llama"))
    model.save_pretrained(tmp_path)
    from safetensors.torch import load_file, save_file

    state = load_file(tmp_path / "model.safetensors")
    del state["model.norm.weight"]
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ckpt = inspect_checkpoint(tmp_path)
    part = even_partition(model_shape(ckpt.config), 1)
    with pytest.raises(PretrainedError, match="no tensor 'model.norm.weight'"):
        load_sharded(ckpt, part, 0)


def test_finetune_command_saves_a_merged_model_from_uneven_shards(runs, tmp_path):
    from hwtopo.testing import assert_fails, run_cli
    from xronos.cli import main

    dirs, _, _ = runs
    out = tmp_path / "merged"
    argv = ["finetune", "--model", str(dirs["qwen2"]), "--save-merged", str(out), "--steps", "2", "--seq-len", "32"]
    argv += ["--batch", "2", "--mlp-block", "16", "--lora-r", "4", "--quiet"]
    res = run_cli(main, argv)
    assert res.code == 0, res.err[-2000:]
    report = json.loads(res.out)
    assert report["saved_merged"] == str(out) and report["eval_loss"] > 0
    assert len(report["load_per_rank"]) == 2
    for load in report["load_per_rank"]:
        assert 0 < load["bytes_read"] < load["checkpoint_bytes"]
    with torch.no_grad():
        logits = _reference(out)(input_ids=fixed_ids()).logits
    assert torch.isfinite(logits).all() and logits.shape == (2, 24, 256)
    (tmp_path / "file").write_text("x")
    argv[argv.index("--save-merged") + 1] = str(tmp_path / "file")
    assert_fails(main, argv, 2, "--save-merged")


def test_tied_bf16_checkpoint_loads_and_saves_in_one_process(tmp_path):
    """A bf16 checkpoint whose LM head is the embedding (small Qwen2 models): read once, cast to fp32,
    the same logits as from_pretrained, and saved back with the tie kept (no lm_head tensor)."""
    from safetensors import safe_open

    from xronos.pretrained import save_merged, split_vocab
    from xronos.shard import enable_lora

    cfg = tiny_config("qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2, tie_word_embeddings=True)
    build_model(cfg, seed=5).to(torch.bfloat16).save_pretrained(tmp_path / "src")
    ckpt = inspect_checkpoint(tmp_path / "src")
    assert split_vocab(ckpt.config, "head") == "none" and split_vocab(_tiny("llama"), "head") == "head"
    model, stats = load_sharded(ckpt, even_partition(model_shape(ckpt.config, 16), 1), 0)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert stats.bytes_read == 2 * stats.params_held and "lm_head.weight" not in stats.reads
    ids = fixed_ids()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, _reference(tmp_path / "src")(input_ids=ids).logits)
    enable_lora(model, 4)
    save_merged(model, tmp_path / "out")
    with safe_open(next((tmp_path / "out").glob("*-00001-of-*.safetensors")), "pt") as f:
        assert "lm_head.weight" not in f.keys()
    with torch.no_grad():
        torch.testing.assert_close(_reference(tmp_path / "out")(input_ids=ids).logits, model(input_ids=ids).logits)


def _save_tokenizer(path, vocab_size):
    """A byte-level BPE tokenizer trained here on a little stdlib text, saved as transformers does."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from xronos.data import stdlib_corpus

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    text = stdlib_corpus(50_000).decode("utf-8", errors="replace")
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["[UNK]"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.save_pretrained(path)
    return fast


def test_the_corpus_uses_the_model_directorys_tokenizer(tmp_path):
    from dist_helpers import small_cfg

    from xronos.data import load_text
    from xronos.pretrained import check_finetune, pretrained_corpus

    small = tiny_config("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=1, vocab_size=200)
    build_model(small).save_pretrained(tmp_path)
    cfg = small_cfg(seq_len=16)
    with pytest.raises(PretrainedError, match="vocab_size 200 is below 256 and there is no tokenizer"):
        check_finetune(tmp_path, cfg, 2)
    fast = _save_tokenizer(tmp_path, 200)
    ckpt = check_finetune(tmp_path, cfg, 2)
    corpus = pretrained_corpus(ckpt, cfg)
    text = load_text(None, cfg.max_bytes).decode("utf-8", "replace")
    want = fast(text)["input_ids"]
    assert corpus.train.tolist() + corpus.eval.tolist() == want
    assert len(want) < 0.9 * len(text.encode())  # tokens, not bytes
    _save_tokenizer(tmp_path, 300)  # a tokenizer whose ids the embedding cannot hold
    with pytest.raises(PretrainedError, match="beyond the model's vocab_size 200"):
        pretrained_corpus(ckpt, cfg)
