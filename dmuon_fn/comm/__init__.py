"""Collectives: errors by phase, JSON agreement, comm counters and timers, mesh checks."""
