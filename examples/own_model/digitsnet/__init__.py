"""An example package that brings its own model, data and loss to scaletrain
(docs/own-model.md). Run from this directory: `scaletrain train config.toml`."""
