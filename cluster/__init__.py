"""cluster: the state and plumbing the router and both worker kinds share, below all of them.

    registry.py            workers' address, shape and load in Redis (heartbeat TTL); routers read it
    prefix_index.py + lua/ which prefill worker holds how long a prefix: the radix index in Redis
    kv_event_publisher.py  a worker's KV events into that index (and a capped Redis stream)
    proto_convert.py       protobuf messages <-> engine objects (sampling parameters, logprobs)
    grpc_plumbing.py       gRPC servers and channels: bounded messages, health, reflection, auth, TLS

Imports only engine, kvtransfer and the generated stubs (duet.v1, duet.internal.v1).
"""
