"""Any transformers model: a model, a config built on the meta device, or a local directory."""

import json
import re

import pytest
import torch
import transformers as T
from torch import nn

import sysprdict
from sysprdict.api import UnsupportedModelError, load_model, predict_memory, predict_time
from sysprdict.cli import main
from sysprdict.overhead import RuntimeOverhead, software_key


def _hwm() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+)", f.read()).group(1)) * 1024


def _neox_config():
    return T.GPTNeoXConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
    )


def test_70b_config_is_predicted_without_allocating_it():
    h, inter, layers, vocab, kv = 8192, 28672, 80, 128256, 8
    cfg = T.LlamaConfig(
        hidden_size=h,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=64,
        num_key_value_heads=kv,
        vocab_size=vocab,
    )
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _hwm()
    pred = predict_memory(cfg, batch=1, seq_len=16, precision="bf16")
    grew = _hwm() - before
    head = h // 64
    per_layer = 2 * h * h + 2 * h * kv * head + 3 * h * inter + 2 * h
    params = 2 * vocab * h + layers * per_layer + h  # untied embedding and head, final norm
    assert pred.factors["parameters"] == 2 * params  # bf16: every one of ~70e9 weights counted
    assert params > 69e9
    # parameters + gradients + two AdamW states, at the least
    assert pred.peak_bytes > 4 * 2 * params
    assert grew < 1 << 30, f"the process grew {grew / 2**20:.0f} MiB while predicting ~{2 * params / 2**30:.0f} GiB"


def test_model_config_and_directory_agree(tmp_path):
    torch.manual_seed(0)
    model = T.GPTNeoXForCausalLM(_neox_config())
    model.save_pretrained(tmp_path)
    from_model = predict_memory(model, batch=2, seq_len=32)
    from_config = predict_memory(_neox_config(), batch=2, seq_len=32)
    from_dir = predict_memory(str(tmp_path), batch=2, seq_len=32)
    assert from_model.peak_bytes == from_config.peak_bytes == from_dir.peak_bytes > 0
    assert sysprdict.predict_memory is predict_memory  # the package's name is this one
    zm = load_model(tmp_path)
    assert zm.modality == "text" and zm.vocab == 300 and next(zm.module.parameters()).is_meta


def test_vision_classifier_config_uses_its_own_image_geometry():
    cfg = T.Dinov2Config(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=56, patch_size=14, num_labels=5
    )
    cfg.architectures = ["Dinov2ForImageClassification"]
    zm = load_model(cfg)
    assert zm.modality == "vision" and zm.image_size == 56 and zm.image_tokens() == 16
    small, large = (predict_memory(cfg, batch=b).peak_bytes for b in (1, 4))
    assert large > small


def test_unknown_module_type_is_one_error_naming_it():
    class Wobble(nn.Module):
        def forward(self, x):
            return x * 2 + 1

    model = T.GPTNeoXForCausalLM(_neox_config())
    model.gpt_neox.layers[0].mlp.act = Wobble()
    with pytest.raises(UnsupportedModelError, match="module type Wobble"):
        predict_memory(model, batch=1, seq_len=8)
    with pytest.raises(UnsupportedModelError, match="zoo model"):
        predict_memory("no-such-model", batch=1)
    with pytest.raises(UnsupportedModelError, match="int"):
        predict_memory(3, batch=1)


def test_predict_time_needs_a_fitted_predictor():
    from sysprdict.layers import decompose
    from sysprdict.timepred import TimePredictor
    from sysprdict.zoo import Shape, build

    ds = [decompose(build(n), Shape(b, 16), "fp32") for n in ("llama-xs", "gpt2-xs") for b in (1, 2, 4)]
    times = [(d.fwd_flops + d.bwd_flops) / 1e9 + 1e-3 for d in ds]
    tp = TimePredictor(kind="additive").fit(ds, times)
    t = predict_time(_neox_config(), tp, batch=2, seq_len=16)
    assert t > 0
    with pytest.raises(ValueError, match="predictor"):
        predict_time(_neox_config(), "fast", batch=1)


def test_cli_predict_model_directory(tmp_path, capsys):
    T.GPTNeoXForCausalLM(_neox_config()).save_pretrained(tmp_path / "m")
    args = ["predict", "--model", str(tmp_path / "m"), "--batch", "2", "--seq", "32", "--precision", "bf16"]
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["memory"]["peak_bytes"] > out["accelerate_style_bytes"] and "runtime" not in out["memory"]
    ov = RuntimeOverhead({"fp32": 2e7, "bf16": 3e7}, 1.25, 0.0, 0.3, 4, ["llama-s"], software_key())
    ov.save(tmp_path / "ov.json")
    assert main([*args, "--json", "--calibration", str(tmp_path / "ov.json")]) == 0
    real = json.loads(capsys.readouterr().out)["memory"]
    assert real["tensor_peak_bytes"] == out["memory"]["peak_bytes"]
    assert real["peak_bytes"] == pytest.approx(3e7 + 1.25 * real["tensor_peak_bytes"])
    assert main(["predict", "--model", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--model" in err and "nothing" in err and "neither a local model directory" in err
    (tmp_path / "empty").mkdir()
    assert main(["predict", "--model", str(tmp_path / "empty")]) == 2
    assert "has no config.json" in capsys.readouterr().err
    assert main(["predict"]) == 2
    err = capsys.readouterr().err
    assert "--model" in err and len(err.strip().splitlines()) == 1


def test_cli_fit_with_a_model_directory_and_a_calibration(tmp_path, capsys):
    T.GPTNeoXForCausalLM(_neox_config()).save_pretrained(tmp_path / "m")
    ov = RuntimeOverhead({"fp32": 2e7}, 1.25, 0.0, 0.3, 4, ["llama-s"], software_key())
    ov.save(tmp_path / "ov.json")
    base = ["fit", "--model", str(tmp_path / "m"), "--seq", "32", "--memory", "64MiB", "--json"]
    assert main(base) == 0
    tensors = json.loads(capsys.readouterr().out)
    assert main([*base, "--calibration", str(tmp_path / "ov.json")]) == 0
    real = json.loads(capsys.readouterr().out)
    # the runtime's share leaves room for fewer samples, and the calibration's margin is kept
    assert real["fits"] and real["batch"] < tensors["batch"]
    assert real["predicted_peak_bytes"] * 1.3 <= 64 * 2**20 and real["margin_bytes"] > 0
    assert main(["fit", "llama-xs", "--model", "llama-xs", "--memory", "1GiB"]) == 2
    assert "once" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_calibrate_for_cuda_without_a_gpu_is_one_clear_error(tmp_path, capsys):
    assert main(["calibrate", "--device", "cuda", "--out", str(tmp_path / "ov.json")]) == 1
    err = capsys.readouterr().err
    assert "cuda" in err and "no CUDA device" in err and "Traceback" not in err
    assert not (tmp_path / "ov.json").exists()


def test_cli_predict_time_from_a_dataset_for_a_model_directory(tmp_path, capsys):
    from sysprdict.dataset import save_rows

    rows = []
    for name in ("llama-xs", "gpt2-xs", "llama-s"):
        for b in (1, 2):
            for prec in ("fp32", "bf16"):
                rows.append(
                    {
                        "model": name,
                        "family": name.split("-")[0],
                        "modality": "text",
                        "batch": b,
                        "seq_len": 16,
                        "image_size": 32,
                        "precision": prec,
                        "optimizer": "adamw",
                        "checkpointing": False,
                        "world_size": 1,
                        "step_time_s": 0.01 * b,
                        "step_cpu_s": 0.01 * b,
                        "peak_bytes": 1,
                    }
                )
    save_rows(tmp_path / "d.jsonl", rows, {})
    T.GPTNeoXForCausalLM(_neox_config()).save_pretrained(tmp_path / "m")
    args = ["predict", "--model", str(tmp_path / "m"), "--batch", "2", "--seq", "16", "--json"]
    assert main([*args, "--dataset", str(tmp_path / "d.jsonl")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["step_time_s"] > 0
