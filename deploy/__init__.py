"""deploy: the local cluster launcher (`duet up`), a private redis-server for it and for tests; later Ray, autoscaler."""
