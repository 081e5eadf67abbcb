"""``mode.policy`` strings to policy objects: the built-in three, and any a user registers before the run is
configured (a plug-in module, a test)."""
from __future__ import annotations

from flodl_exp.policy.base import AveragingPolicy
from flodl_exp.policy.builtin import BUILTIN

_POLICIES: dict[str, AveragingPolicy] = {p.name: p for p in BUILTIN}


def register_policy(policy: AveragingPolicy) -> AveragingPolicy:
    """Make ``policy`` available as ``mode.policy=<policy.name>``; a name already taken is a ValueError (a
    built-in cannot be replaced by accident)."""
    name = policy.name
    if not name or not name.isidentifier() or name != name.lower():
        raise ValueError(f"policy name {name!r}: a lower-case identifier (a mode is named <backend>_<policy>)")
    if name in _POLICIES and _POLICIES[name] is not policy:
        raise ValueError(f"policy name {name!r} is taken by {_POLICIES[name]!r}")
    _POLICIES[name] = policy
    return policy


def unregister_policy(name: str) -> None:
    """Forget a registered policy (a test's cleanup); the built-ins stay."""
    if name in {p.name for p in BUILTIN}:
        raise ValueError(f"policy {name!r} is built in")
    _POLICIES.pop(name, None)


def policy_named(name: str) -> AveragingPolicy:
    """The policy ``mode.policy=name`` selects; KeyError when none is registered by that name."""
    return _POLICIES[str(name)]


def policy_names() -> tuple[str, ...]:
    """Every policy name known now, the built-ins first."""
    return tuple(_POLICIES)
