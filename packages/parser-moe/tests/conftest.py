import os

import pytest
import torch

torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: slower end-to-end tests (still run in nox)")


def tiny_config(family: str = "qwen2_moe", experts: int = 4, layers: int = 2):
    import transformers as T

    common = dict(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=24,
        max_position_embeddings=64,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    if family == "qwen2_moe":
        return T.Qwen2MoeConfig(
            **common,
            num_experts=experts,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
        )
    if family == "qwen3_moe":
        return T.Qwen3MoeConfig(
            **common, num_experts=experts, num_experts_per_tok=2, moe_intermediate_size=16, head_dim=8
        )
    if family == "olmoe":
        return T.OlmoeConfig(**common, num_experts=experts, num_experts_per_tok=2)
    if family == "mixtral":
        return T.MixtralConfig(**common, num_local_experts=experts, num_experts_per_tok=2)
    if family in ("deepseek_v2", "deepseek_v3"):
        cls = T.DeepseekV2Config if family == "deepseek_v2" else T.DeepseekV3Config
        return cls(
            **common,
            n_routed_experts=experts,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            n_shared_experts=1,
            first_k_dense_replace=0,
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            n_group=1,
            topk_group=1,
        )
    raise ValueError(family)


def tiny_model(family: str = "qwen2_moe", seed: int = 0, **kw):
    import transformers as T

    torch.manual_seed(seed)
    model = T.AutoModelForCausalLM.from_config(tiny_config(family, **kw)).eval()
    # spread the router so every expert gets tokens from little text
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight") and p.dim() == 2 and "shared" not in name:
                p.normal_(0, 0.5)
    return model


@pytest.fixture
def ids():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 64, (4, 32), generator=g)
