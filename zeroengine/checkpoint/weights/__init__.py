"""Model weights as files: safetensors read a byte range at a time (weight_files.py), the
Hugging Face layout of one or many files with its index (hf_layout.py), and a live engine's
weights written in it (hf_export.py)."""
