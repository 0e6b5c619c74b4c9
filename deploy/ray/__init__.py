"""duet on Ray: cluster.yaml for `ray up`, and the launcher behind `duet ray up` (launcher.py)."""
