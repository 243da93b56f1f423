"""Test support shipped with kvserve: tiny checkpoints built from scratch, fault injection for model steps, and the
plain reference computations kernels are checked against. Nothing in the serving path imports this package unless
a test asks for it (`KVSERVE_FAULT_INJECTION`)."""
