"""Frameworks on streamload's public API: `transformers` and `diffusers` (behind `streamload.from_pretrained`,
in `pretrained`), `vllm` (the "streamload" load format); `startup`: the work ahead of a framework's import. This
package imports nothing (`python -m streamload.integrations.startup.prefetch` starts light)."""
