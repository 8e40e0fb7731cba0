"""An example package that brings its own model, data and loss to scaletrain (README,
"Bring your own model"). Run from this directory: `scaletrain train config.toml`."""
