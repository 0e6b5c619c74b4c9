import os
import sys

# see tests/conftest.py: `duet up` / `duet demo` fork + exec components while gRPC may run (grpc/grpc#43055)
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from duet.cli import main  # noqa: E402

sys.exit(main())
