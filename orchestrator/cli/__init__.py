"""The ``claw`` command line: the app (``app``, ``main``), the commands (``commands/``, one
module per group) and what they run that lives nowhere else: the dev stack, the demo, the
Prometheus exporter, ``doctor``, archive runs with progress bars, retention options and
the gateway's options."""
