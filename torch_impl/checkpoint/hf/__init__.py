"""Hugging Face MoE checkpoints in and out of moezero: Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE
(the mapping is docs/hf.md).

``import_hf(src, out)`` reads a local model directory (``config.json``, safetensors shards,
optionally ``model.safetensors.index.json``); its ``model_type`` picks the family. It writes a
*weights-only* moezero checkpoint: the plan's layout, weights in the source dtype keyed by FQNs
(global expert ids), no optimizer files, step 0, committed atomically, and ``config.yaml``.
``export_hf(ckpt, out)`` writes any moezero checkpoint as ``config.json`` + safetensors +
index that the family's ``*ForCausalLM.from_pretrained`` loads. Only JSON and safetensors are
read; neither transformers nor a process group is needed.

Modules: ``arch`` (the architecture in moezero's names, shared config checks), ``family`` and
one module per family (config reader/writer, names, what it cannot hold), ``families`` (the
registry and the choice), ``names`` (FQN ↔ key), ``reader`` (the source tensors),
``importer`` and ``exporter``; ``peft_export``: a LoRA checkpoint as a PEFT adapter
(``--format peft``) or merged (``--merge-lora``).
"""

from moezero.checkpoint.hf.arch import Arch, arch_of
from moezero.checkpoint.hf.exporter import export_hf, num_params
from moezero.checkpoint.hf.families import FAMILIES, family_for, family_of_config
from moezero.checkpoint.hf.importer import import_config, import_hf, read_hf_config
from moezero.checkpoint.hf.names import hf_name

__all__ = ["FAMILIES", "Arch", "arch_of", "export_hf", "family_for", "family_of_config",
           "hf_name", "import_config", "import_hf", "num_params", "read_hf_config"]
