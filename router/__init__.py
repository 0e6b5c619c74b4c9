"""router: the public gRPC API (+ OpenAI HTTP), tokenization, request orchestration and routing policies.
Imports engine, cluster and the generated stubs; never a worker or deploy module."""
