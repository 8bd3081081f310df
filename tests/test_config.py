"""ModelConfig: presets, validation messages, HF config.json in both dialects, round trips."""

from __future__ import annotations

import json

import pytest

from openk3.config import KDAConfig, KDAGate, LayerKind, MoEConfig, config_from_hf, config_to_hf, debug, k3, kimi_linear_48b, preset, tiny


def test_k3_schedule_and_features() -> None:
    c = k3()
    mla = [i for i, k in enumerate(c.layer_kinds) if k == LayerKind.MLA]
    assert len(mla) == 24 and mla[:3] == [3, 7, 11] and mla[-2:] == [91, 92]
    assert len(c.kda_layers) == 69
    assert not c.is_moe_layer(0) and all(c.is_moe_layer(i) for i in range(1, 93))
    assert c.kda.gate == KDAGate.LOWER_BOUND and c.kda.gate_lower_bound == -5.0 and c.kda.full_rank_output_gate
    assert c.mla.latent_dim == 576 and c.mla.output_gate and c.attn_res_block_size == 12


def test_layer_param_counts_match_spec() -> None:
    c = k3()
    assert round(c.kda_layer_params() / 1e6, 1) == 443.7
    assert round(c.mla_layer_params() / 1e6, 1) == 232.2
    assert round(c.routed_expert_params() / 1e6, 2) == 33.03
    assert round(c.moe_layer_fixed_params() / 1e6, 1) == 189.9


def test_tiny_is_demo_sized_with_every_feature() -> None:
    c = tiny()
    assert 10e6 <= c.param_count().total <= 20e6
    assert c.attn_res_block_size and c.moe.latent_size and c.mla.output_gate and c.kda.gate == KDAGate.LOWER_BOUND
    assert c.expert_quantization == "mxfp4"


@pytest.mark.parametrize("make", [debug, tiny, kimi_linear_48b, k3])
def test_hf_round_trip(make) -> None:
    c = make()
    assert config_from_hf(config_to_hf(c)) == c
    assert config_from_hf({"model_type": "kimi_k3", "text_config": config_to_hf(c)}) == c
    json.dumps(config_to_hf(c))


def test_reads_moonshot_style_kimi_linear_config() -> None:
    raw = {
        "model_type": "kimi_linear",
        "vocab_size": 163840,
        "hidden_size": 2304,
        "num_hidden_layers": 27,
        "intermediate_size": 9216,
        "moe_intermediate_size": 1024,
        "num_attention_heads": 32,
        "q_lora_rank": None,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "num_experts": 256,
        "num_experts_per_token": 8,
        "num_shared_experts": 1,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.446,
        "moe_renormalize": True,
        "hidden_act": "silu",
        "linear_attn_config": {"full_attn_layers": [4, 8, 12, 16, 20, 24, 27], "kda_layers": [], "num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4},
    }
    c = config_from_hf(raw)
    ref = kimi_linear_48b()
    assert c.mla_layers == ref.mla_layers and c.kda == ref.kda and c.moe == ref.moe and c.param_count() == ref.param_count()


def test_missing_field_is_named() -> None:
    raw = config_to_hf(debug())
    del raw["kv_lora_rank"]
    with pytest.raises(ValueError, match="kv_lora_rank"):
        config_from_hf(raw)


def test_validation_names_field_and_range() -> None:
    with pytest.raises(ValueError, match=r"moe.num_experts_per_token=9.*1\.\.8"):
        MoEConfig(num_experts=8, num_experts_per_token=9, moe_intermediate_size=32)
    with pytest.raises(ValueError, match="kda.gate_lower_bound"):
        KDAConfig(num_heads=2, head_dim=16, gate=KDAGate.LOWER_BOUND, gate_lower_bound=None)
    with pytest.raises(ValueError, match="None when gate='softplus'"):
        KDAConfig(num_heads=2, head_dim=16, gate=KDAGate.SOFTPLUS, gate_lower_bound=-5.0)
    with pytest.raises(ValueError, match="mla_layers"):
        debug().replace(mla_layers=(7,))
    with pytest.raises(ValueError, match="hidden_size"):
        debug().replace(hidden_size=0)
    with pytest.raises(ValueError, match="multiple of 32"):
        debug().replace(expert_quantization="mxfp4", moe=MoEConfig(num_experts=8, num_experts_per_token=2, moe_intermediate_size=33))
    with pytest.raises(ValueError, match="unknown model preset 'huge'"):
        preset("huge")


def test_reference_field_names_and_refusals() -> None:
    raw = config_to_hf(debug())
    assert raw["activation_situ_beta"] == 4.0 and "situ_beta" not in raw
    raw["activation_situ_beta"], raw["activation_situ_linear_beta"] = 2.0, 10.0
    c = config_from_hf(raw)
    assert (c.situ_beta, c.situ_linear_beta) == (2.0, 10.0)
    raw["num_shared_experts"] = None
    assert config_from_hf(raw).moe.num_shared_experts == 0
    for field, value in (("moe_router_activation_func", "softmax"), ("moe_layer_freq", 2)):
        bad = config_to_hf(debug())
        bad[field] = value
        with pytest.raises(ValueError, match=field):
            config_from_hf(bad)


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"mla_use_nope": False}, "mla_use_nope"),
        ({"num_expert_group": 2}, "num_expert_group"),
        ({"use_grouped_topk": True, "topk_group": 2}, "topk_group"),
        ({"topk_method": "greedy"}, "topk_method"),
        ({"num_key_value_heads": 1}, "num_key_value_heads"),
    ],
)
def test_keys_that_change_the_math_are_refused_by_name(changes, named) -> None:
    bad = config_to_hf(debug()) | changes
    with pytest.raises(ValueError, match=named):
        config_from_hf(bad)


def test_the_release_values_of_those_keys_load() -> None:
    raw = config_to_hf(debug()) | {"use_grouped_topk": True, "topk_group": 1, "topk_method": "noaux_tc", "mla_use_nope": True}
    assert config_from_hf(raw) == debug()
