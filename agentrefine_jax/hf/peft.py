"""A LoRA run as a PEFT adapter directory (what peft, vLLM and LLaMA-Factory load).

    adapter_config.json          peft_type LORA, r, lora_alpha, target_modules, base_model_name_or_path
    adapter_model.safetensors    base_model.model.<module>.lora_A.weight [r, in] / lora_B.weight [out, r]
    base/                        the frozen base in HF format, when it did not come from an HF dir

`base_model_name_or_path` is the HF directory the run started from (train.init_from_hf), or
"base" — the copy written beside the adapter — relative to the adapter directory.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable
from typing import Any

from agentrefine_jax.hf.io import save_safetensors
from agentrefine_jax.models import lora
from agentrefine_jax.outputs import json_dumps

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
BASE_SUBDIR = "base"


def adapter_config(spec: lora.LoraSpec, base_name_or_path: str) -> dict[str, Any]:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_name_or_path,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": lora.peft_target_modules(spec),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }


def write_peft_adapter(
    out: str | pathlib.Path,
    spec: lora.LoraSpec,
    adapters: lora.Adapters,
    base_hf_dir: str | None,
    *,
    write_base: Callable[[pathlib.Path], None],
) -> pathlib.Path:
    """Write the adapter directory; `write_base(dir)` writes the HF base when there is no HF dir to name."""
    out = pathlib.Path(out)
    if (out / ADAPTER_CONFIG).exists() or (out / "config.json").exists():
        raise FileExistsError(f"{out} already holds a model or adapter; choose an empty directory")
    out.mkdir(parents=True, exist_ok=True)
    if base_hf_dir is not None:
        base = str(pathlib.Path(base_hf_dir).resolve())
    else:
        write_base(out / BASE_SUBDIR)
        base = BASE_SUBDIR
    save_safetensors(lora.to_peft(adapters, spec), out / ADAPTER_WEIGHTS)
    (out / ADAPTER_CONFIG).write_text(json_dumps(adapter_config(spec, base), indent=2) + "\n")
    return out


def is_adapter_dir(path: str | pathlib.Path) -> bool:
    """Whether `path` is a PEFT adapter directory (it has adapter_config.json)."""
    return (pathlib.Path(path) / ADAPTER_CONFIG).is_file()


def base_path(adapter_dir: str | pathlib.Path) -> pathlib.Path:
    """The base model directory an adapter directory names (a relative name is inside it)."""
    adapter_dir = pathlib.Path(adapter_dir)
    name = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())["base_model_name_or_path"]
    p = pathlib.Path(name)
    return p if p.is_absolute() else adapter_dir / p
