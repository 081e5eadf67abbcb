"""The wire's error type, apart from the wire (sockets, threads): the protocol's payloads raise it too
(:class:`~flodl_exp.protocol.messages.ProtocolError`), and the control core imports them, not the wire."""
from __future__ import annotations


class WireError(Exception):
    """Malformed frame, protocol violation, or a stream that is no longer usable."""
