"""The package's version, in a leaf: data writers stamp it into their manifests without
importing the package root (which lazily exports the Python API, the top floor)."""

__version__ = "0.1.0"  # keep equal to pyproject.toml's [project] version
