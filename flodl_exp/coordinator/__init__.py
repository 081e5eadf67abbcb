"""The coordinator's process: the shell around the control core (the rank server and its wire outbox, the
event log, the bundle files, the window records, the timeline, the stall watchdog, mode=auto's probe and the
prediction) and ``main``, the process entry."""
