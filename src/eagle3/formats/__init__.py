"""Save and load EAGLE-3 drafter checkpoints in the two formats serving engines read, and check them against a target.

* **speculators** (what `vllm serve <dir>` reads; vllm-project/speculators `src/speculators/models/eagle3/config.py`):
  `config.json` with `speculators_config` and a nested Llama `transformer_layer_config`; weights named `layers.0.*`.
* **eagle** (native EAGLE-3, read by SGLang and SafeAILab/EAGLE; `eagle/traineagle3/config.json`): a flat Llama
  config with `architectures: ["LlamaForCausalLMEagle3"]`; the decoder layer's weights are named `midlayer.*`.

Both formats carry `d2t` (int64 offsets, `target = draft + d2t[draft]`) and `t2d` (bool mask over the target
vocabulary) when the draft vocabulary is reduced. eagle3 also writes an `"eagle3"` key (other loaders ignore it)
holding what the formats lack: the target's layer count and the aux layer ids in vLLM convention.

Modules: `configs` (`config.json` <-> `DrafterConfig`, format detection; its docstring gives the aux-layer-id
convention and the loader defaults eagle3 writes out), `validate` (the draft-vocabulary map and a drafter against
a target's config), `io` (reading, loading, casting, saving and converting checkpoint directories). Import from
`eagle3.formats`; everything below is re-exported here.
"""

from eagle3.formats.configs import (
    EXTRAS_KEY,
    FORMATS,
    NATIVE_ARCHITECTURES,
    SPECULATORS_ARCHITECTURES,
    SPECULATORS_FORMAT_VERSION,
    config_from_dict,
    detect_format,
    native_aux_ids_to_vllm,
    native_config_dict,
    speculators_config_dict,
)
from eagle3.formats.io import (
    WEIGHTS_NAME,
    cast_drafter,
    drafter_state_dict,
    export_drafter,
    load_drafter,
    load_target_config,
    read_checkpoint,
    read_vocab_mapping,
    save_drafter,
)
from eagle3.formats.validate import check_vocab_mapping, validate_against_target

__all__ = [
    "EXTRAS_KEY",
    "FORMATS",
    "NATIVE_ARCHITECTURES",
    "SPECULATORS_ARCHITECTURES",
    "SPECULATORS_FORMAT_VERSION",
    "WEIGHTS_NAME",
    "cast_drafter",
    "check_vocab_mapping",
    "config_from_dict",
    "detect_format",
    "drafter_state_dict",
    "export_drafter",
    "load_drafter",
    "load_target_config",
    "native_aux_ids_to_vllm",
    "native_config_dict",
    "read_checkpoint",
    "read_vocab_mapping",
    "save_drafter",
    "speculators_config_dict",
    "validate_against_target",
]
