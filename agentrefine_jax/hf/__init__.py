"""Hugging Face checkpoints: read a transformers Llama/Mistral directory into our model, write one back.

`hf.io` is the one layer that touches HF files; training (`init_from_hf`), export and inference
all go through it. Names and layouts come from the parameter table in `models/params.py`.
"""
