"""The K3 model: single-device nn.Modules built from a ModelConfig, and checkpoint loading."""

from openk3.model.batch import CacheTensors, ForwardBatch
from openk3.model.checkpoint import CheckpointError
from openk3.model.model import K3ForCausalLM, OpChoice
from openk3.model.weights import load_model, save_model

__all__ = ["CacheTensors", "CheckpointError", "ForwardBatch", "K3ForCausalLM", "OpChoice", "load_model", "save_model"]
