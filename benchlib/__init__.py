"""benchlib: measure memory, allocations and GC pauses of gradient engines (see docs/architecture.md)."""
