"""pdserve: disaggregated prefill/decode LLM serving. The CLI lives in pdserve.cli."""

__version__ = "0.1.0"

import os as _os

# before anything loads torch's libgomp: see engine_core/__init__.py (a user's value wins;
# the user's own, None if unset, for what runs another checkout's code: pdserve bench)
USER_GOMP_SPINCOUNT = _os.environ.get("GOMP_SPINCOUNT")
_os.environ.setdefault("GOMP_SPINCOUNT", "3000")
