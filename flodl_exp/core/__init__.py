"""The control core: every decision of a run (who is in, when to average, what each rank trains, faults,
bundles, the run's end), sans-I/O. ``control_core.ControlCore.handle(event) -> list[Command]`` is its one entry
point and ``view.CoreView`` what a shell reads; time comes in with the events, and tensors, files and sockets sit
behind ports (``averager``, ``bundle_store``, ``outbox``, ``ports``) the shells implement.
tests/test_core_import_contract.py holds the package to it."""
