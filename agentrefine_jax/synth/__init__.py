"""Synthesis of refinement-tuning data (paper §3): persona -> script -> DM/Player trajectory
-> Algorithm 1 verification (regenerating from the verified prefix) -> canonical chat rows.

Entry points: `python -m agentrefine_jax.synth {generate,verify,convert}`,
`verify.verify_trajectory` and `convert.to_chat`.
"""
