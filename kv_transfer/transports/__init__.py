"""The KV transports' data planes, one module each: grpc (any two hosts), shm and cuda_ipc
(same host, sharing one_sided.py's session)."""
