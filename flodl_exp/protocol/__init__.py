"""What crosses a process boundary: the message kinds (``messages``, pure), their wire form (``codec``), the
framed, authenticated socket (``wire``), a rank's hello (``hello``) and the wire's errors (``errors``)."""
