"""pdserve: disaggregated prefill/decode LLM serving. The CLI lives in pdserve.cli."""

__version__ = "0.1.0"
