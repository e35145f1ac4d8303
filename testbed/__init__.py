"""What the tests, the benchmarks (bench/) and the examples build on, outside the package and outside the
test suite: a simulated network of hosts (netsim), one node of a fleet on it (fleet_node), small diffusers
pipelines (diffusers_pipelines) and quantized checkpoints in their tools' layouts (quantized_layouts).
Not installed with streamload (pyproject.toml packages only `streamload*`); run from the repository's root."""
