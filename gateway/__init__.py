"""The public front door: gRPC + OpenAI HTTP APIs over a Backend (colocated or disaggregated)."""
