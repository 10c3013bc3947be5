"""Packaging: the built wheel installs and loads its entry points; setup scripts' choices (needs uv, no server)."""
