"""The decode pool's worker: receives prompt KV from prefill workers and decodes in batches."""
