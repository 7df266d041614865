"""How far apart a LoRA run's models are (docs/lora.md, "Export"; issue 45).

    python benchmarks/lora_handoffs.py RUN ADAPTER MERGED [OUT.json]

RUN: a LoRA run; ADAPTER: its `export to-hf` directory; MERGED: its `export to-hf --merge-lora
--export-dtype float32` directory. Prints: the merged export's untouched tensors against the base
directory the adapter names (bit-identical count), its targeted tensors against peft's own
`merge_and_unload`, and max |Δlogit| on 2 x 64 random ids of PEFT(base, adapter) vs the merged
export (float32 and float64 compute), the adapters' effect (PEFT vs the base alone) and the
trained model (`load_model`: the base as the run held it + adapters) against PEFT; with OUT.json,
the same figures and the machine record as JSON.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _machine  # noqa: E402


def _tensors(d: pathlib.Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    out: dict[str, np.ndarray] = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def main(
    run: pathlib.Path, adapter: pathlib.Path, merged: pathlib.Path, out: pathlib.Path | None = None
) -> None:
    import jax.numpy as jnp
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    from agentrefine_jax.checkpoint import load_model
    from agentrefine_jax.hf.peft import base_path

    machine = _machine.machine()
    print(_machine.header(), flush=True)
    figures: dict[str, float | str] = {}
    base_dir = base_path(adapter)
    targets = json.loads((adapter / "adapter_config.json").read_text())["target_modules"]
    base_t, merged_t = _tensors(base_dir), _tensors(merged)
    untouched = [k for k in base_t if not any(f".{t}." in k for t in targets)]
    same = sum(
        base_t[k].dtype == merged_t[k].dtype and np.array_equal(base_t[k], merged_t[k]) for k in untouched
    )
    worst = max(float(np.abs(base_t[k].astype(np.float64) - merged_t[k]).max()) for k in untouched)
    figures["untouched_identical"] = f"{same}/{len(untouched)}"
    print(f"untouched tensors bit-identical to the base: {same}/{len(untouched)} (max |Δ| {worst:.3g})")

    def load(where: pathlib.Path, dtype: torch.dtype) -> torch.nn.Module:
        return AutoModelForCausalLM.from_pretrained(where, dtype=dtype).eval()

    def peft_on_base(dtype: torch.dtype) -> torch.nn.Module:
        return peft.PeftModel.from_pretrained(load(base_dir, dtype), adapter).eval()

    peft_merged = peft_on_base(torch.float32).merge_and_unload()
    theirs = {k: v.numpy() for k, v in peft_merged.state_dict().items()}
    targeted = max(float(np.abs(theirs[k] - merged_t[k]).max()) for k in base_t if k not in untouched)
    figures["targeted_vs_merge_and_unload"] = targeted
    print(f"targeted tensors vs peft's merge_and_unload: max |Δ| {targeted:.3g}")

    ids = torch.as_tensor(
        np.random.RandomState(0).randint(0, len(base_t["model.embed_tokens.weight"]), (2, 64))
    )
    with torch.no_grad():
        for dtype in (torch.float32, torch.float64):
            model = peft_on_base(dtype)
            via_peft = model(ids).logits.double().numpy()
            via_merged = load(merged, dtype)(ids).logits.double().numpy()
            gap = np.abs(via_peft - via_merged).max()
            figures[f"peft_vs_merged_{str(dtype).split('.')[-1]}"] = float(gap)
            print(f"PEFT(base, adapter) vs merged export, {dtype}: max |Δlogit| {gap:.3g}")
            if dtype == torch.float32:
                with model.disable_adapter():
                    effect = np.abs(via_peft - model(ids).logits.double().numpy()).max()
                peft32 = via_peft
        own = np.abs(peft_merged(ids).logits.double().numpy() - peft32).max()
    print(f"peft's own merged model vs its unmerged forward, float32: max |Δlogit| {own:.3g}")
    print(f"adapters' effect (PEFT vs the base alone): max |Δlogit| {effect:.3g}")
    _, trained, meta = load_model(run, dtype="float32")
    ours = np.asarray(trained(jnp.asarray(ids.numpy(), jnp.int32)))
    figures.update(peft_own_merge=float(own), adapters_effect=float(effect))
    figures["trained_vs_peft"] = float(np.abs(ours - peft32).max())
    print(
        f"trained model (base as held: {meta.lora.base_dtype}, + adapters) vs PEFT: "
        f"max |Δlogit| {figures['trained_vs_peft']:.3g}"
    )
    if out is not None:
        from agentrefine_jax.outputs import write_json

        write_json(out, {"figures": figures, "machine": machine})


if __name__ == "__main__":
    if len(sys.argv) not in (4, 5):
        sys.exit(__doc__)
    main(*(pathlib.Path(a) for a in sys.argv[1:]))
