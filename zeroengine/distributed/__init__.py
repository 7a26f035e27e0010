"""Distributed plumbing: collectives and async handles, joining the process group from a
launcher's environment, the network interface, cross-rank consistency checks."""
