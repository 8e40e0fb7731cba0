"""What a run records: metrics.jsonl and TensorBoard (metrics), the PNG report (report), and
memory counters (memory). Readable without torch.distributed."""
