"""Data: built-in sources in memory (`sources`), file sources (`file_source`), the sampler,
Parquet shards (format and checks: `manifest`; reader: `shards`; writers: `shard_writer`,
`spark`), the train/eval hold-out rule (`holdout`), pre-launch checks (`preflight`), and
the one place a source name becomes a dataset (`loader`)."""
