"""Model configuration: one frozen dataclass that describes K3, Kimi-Linear and the small test/demo models.

- `model.py`: ModelConfig and its parts (KDA, MLA, MoE), validated in `__post_init__`; `param_count()` without allocating;
- `presets.py`: k3(), kimi_linear_48b(), tiny(), debug() and `preset(name)`;
- `hf.py`: HF config.json in (`config_from_hf`) and out (`config_to_hf`, `save_config`).
"""

from openk3.config.hf import config_from_hf, config_to_hf, save_config
from openk3.config.model import Activation, KDAConfig, KDAGate, LayerKind, MLAConfig, ModelConfig, MoEConfig, ParamCount
from openk3.config.presets import PRESETS, debug, k3, k3_schedule, kimi_linear_48b, preset, tiny

__all__ = [
    "PRESETS",
    "Activation",
    "KDAConfig",
    "KDAGate",
    "LayerKind",
    "MLAConfig",
    "ModelConfig",
    "MoEConfig",
    "ParamCount",
    "config_from_hf",
    "config_to_hf",
    "debug",
    "k3",
    "k3_schedule",
    "kimi_linear_48b",
    "preset",
    "save_config",
    "tiny",
]
