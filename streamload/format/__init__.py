"""The safetensors format: headers parsed and validated, dtypes. No I/O policy, no CUDA."""
