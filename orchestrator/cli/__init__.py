"""The ``claw`` command line and its dev tools (dev stack, demo, doctor, metrics)."""
