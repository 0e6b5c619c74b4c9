"""deploy: the local cluster launcher (`duet up`) and a private redis-server for it and for tests."""
