"""duet: the command line (`duet ...`, cli*.py), the demo and the Python client of the public API.
Nothing else imports it. duet/v1 and duet/internal/v1 are the generated gRPC stubs, named by their proto
packages (proto/generate.py); they import nothing of ours, and every layer may use them."""
