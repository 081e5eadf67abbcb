"""The averaging policies: when replicas are averaged, and what each policy answers for the core (the gate's
target, a rank's budget between reduces, whether epochs advance in lockstep, ...). Pure: no I/O, no torch.

A policy is one object (``base.AveragingPolicy``); the built-in ones are in ``builtin``; ``registry`` maps
``mode.policy`` strings to them. Adding a policy is a subclass, one ``register_policy`` call and a
``conf/mode/<backend>_<name>.yaml`` preset.
"""
