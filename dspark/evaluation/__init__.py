"""Benchmarks and clients: `dspark bench`, `dspark loadtest`, the shared prompt sets, the HTTP/gRPC client."""
