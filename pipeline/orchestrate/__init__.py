"""Run the whole loop on one machine: ``pipeline up`` (every stage as its own process) and
``pipeline demo`` (up + simulated users until K trainer steps, then a report)."""
