"""Frameworks on streamload's public API, one module each: `transformers` and `diffusers` (behind
`streamload.from_pretrained`, in `pretrained`), `vllm` (the "streamload" load format, its dry run and weight
sync); `startup`: the work ahead of a framework's import that they and the commands share. Importing this
package imports nothing else (`python -m streamload.integrations.startup.prefetch` starts light)."""
