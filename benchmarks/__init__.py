"""benchmarks: comparisons against peers and ceilings (scripts), and the simulators in sim/."""
