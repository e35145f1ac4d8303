"""Loading into torch modules: `load_into`, `offload` (models larger than memory), layers as they complete."""
