"""Hugging Face interop: `python -m agentrefine_jax.export {from-hf,to-hf,verify}` (see docs/export.md).

Library entry points: `hf_io.read_hf_config`, `hf_io.load_hf_model`, `hf_io.save_hf`,
`verify.verify`; the name/layout mapping lives in `mapping`.
"""
