"""Hugging Face interop CLI: `python -m agentrefine_jax.export {from-hf,to-hf,verify}` (see docs/export.md).

The HF files themselves are read and written by `agentrefine_jax.hf.io`; `export.parity` (the
`verify` subcommand) checks an exported directory against transformers' forward pass.
"""
